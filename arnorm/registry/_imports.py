"""Importing plugin modules, bounded in time: a plugin's import may block forever.

An entry point's module (discovery) and a backend's module (its first probe) are imported on a
daemon helper thread; the caller waits at most the probe timeout, then reports the plugin as
broken ("import: no answer in 15 s, still running (needs ...)") and carries on. Python cannot stop
a thread, and the import left running holds that module's import lock: any later import of the
same module, from any thread of the process (arnorm's or the application's own ``import``), waits
until it returns. So arnorm never starts a second import of a module whose first one is still
running: a later request waits only for what is left of its own timeout after the first one
started (nothing, once that has passed) and reports the same reason, or takes the first import's
outcome once it has finished. At most one thread per module is ever left behind, and it is a
daemon thread: it does not keep the interpreter from exiting.

Reads no torch: discovery imports this.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from arnorm._config import DEFAULT_PROBE_TIMEOUT, MAX_TIMEOUT

__all__ = ["discovery_timeout", "import_bounded", "timed_out"]


@dataclass
class _Import:
    thread: threading.Thread
    started: float
    outcome: list[tuple[str, Any]] = field(default_factory=list)


_lock = threading.Lock()
_running: dict[str, _Import] = {}


def _run(module: str, outcome: list[tuple[str, Any]]) -> None:
    try:
        outcome.append(("ok", importlib.import_module(module)))
    except BaseException as exc:  # plugin code may raise anything, SystemExit included
        outcome.append(("raised", exc))


def import_bounded(module: str, timeout: float) -> tuple[str, Any]:
    """Import ``module`` waiting at most ``timeout`` seconds: ``("ok", module)``, ``("raised",
    exception)`` or ``("timeout", None)`` (the import goes on, on its thread; see the module docstring)."""
    done = sys.modules.get(module)
    if done is not None and not getattr(getattr(done, "__spec__", None), "_initializing", False):
        return "ok", done  # imported already (every op built after the first): no thread
    with _lock:
        entry = _running.get(module)
        if entry is None:
            entry = _Import(threading.Thread(), time.monotonic())
            entry.thread = threading.Thread(
                target=_run, args=(module, entry.outcome), daemon=True, name="arnorm-import"
            )
            _running[module] = entry
            entry.thread.start()
    entry.thread.join(max(0.0, entry.started + timeout - time.monotonic()))
    if not entry.outcome:
        return "timeout", None
    with _lock:
        if _running.get(module) is entry:
            del _running[module]
    return entry.outcome[0]


def timed_out(timeout: float, what: str = "module") -> str:
    """The reason for an import that did not return in ``timeout`` seconds, in the grammar."""
    return (
        f"import: no answer in {timeout:g} s, still running (needs a {what} whose import returns within "
        "ARNORM_PROBE_TIMEOUT / Config.probe_timeout; this process will not import it again)"
    )


def discovery_timeout() -> float:
    """The bound on each entry point's import: ``ARNORM_PROBE_TIMEOUT`` when it is a valid value, else
    the default (a malformed value is reported by ``Config``, not here: discovery runs before it)."""
    try:
        value = float(os.environ.get("ARNORM_PROBE_TIMEOUT", ""))
    except ValueError:
        return DEFAULT_PROBE_TIMEOUT
    return value if 0 < value <= MAX_TIMEOUT else DEFAULT_PROBE_TIMEOUT
