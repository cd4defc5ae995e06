"""Probing one backend on this rank: load its class, run its probe, each bounded in time, cached.

A probe is plugin code: it may raise anything, hang, or return garbage. Each outcome becomes a
verdict here (``"broken"`` or ``"incompatible"`` with reasons in the grammar), never an exception in
the caller. The backend's module is imported within ``timeout`` seconds first
(:mod:`arnorm.registry._imports`: an import that never returns is ``"import: no answer in ..."``). The probe
runs on a helper thread with the op's device current, so a probe that does not answer within
``timeout`` seconds is a rejection ("probe: no answer in 15 s ...") while the thread is left to
finish on its own. Results are cached per process for an identical problem.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from arnorm.registry._failure import plugin_failure
from arnorm.registry._imports import import_bounded, timed_out

if TYPE_CHECKING:
    from arnorm._problem import Problem
    from arnorm.registry._spec import BackendSpec

__all__ = ["clear_probe_cache", "load_class", "probe"]

#: Probe results kept (least recently stored first out): one per (backend, problem, device), so a
#: process building ops for many shapes cannot grow it without end. A probe that hung is cached
#: as broken too, so its (daemon) thread is the only one it ever leaves behind.
CACHE_SIZE = 256
_cache: OrderedDict[tuple[Any, ...], tuple[str, tuple[str, ...]]] = OrderedDict()
_lock = threading.Lock()


def clear_probe_cache() -> None:
    with _lock:
        _cache.clear()


def load_class(spec: BackendSpec, timeout: float) -> tuple[Any, str]:
    """``(class, "")``, or ``(None, reason)`` when the module fails to import within ``timeout``
    seconds (:func:`arnorm.registry._imports.import_bounded`) or breaks the protocol."""
    try:
        status, got = import_bounded(spec.loader.partition(":")[0], timeout)
        if status == "timeout":
            return None, timed_out(timeout, f"module for backend {spec.name!r}")
        if status == "raised":
            raise got
        return spec.load(), ""  # imported above: only the attribute lookup and protocol check are left
    except BaseException as exc:  # the backend module may raise anything on import
        text = str(exc)
        if isinstance(exc, TypeError) and text.startswith(("protocol:", "loader:")):
            return None, text  # the class loaded but breaks the protocol: already a reason
        return None, f"import: {plugin_failure(exc)} (needs a working install of backend {spec.name!r})"


def _run(cls: Any, problem: Problem, device: Any, out: list[Any]) -> None:
    try:
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            torch.cuda.set_device(device)
        result = cls.probe(problem)
        # One pass over the result: a probe written with ``yield`` is read once, not consumed twice.
        reasons = None if isinstance(result, str) else tuple(result)
        if reasons is None or not all(isinstance(r, str) for r in reasons):
            msg = f"probe returned {result!r} (needs a sequence of reason strings)"
            raise TypeError(msg)
        out.append(("ok", reasons))
    except BaseException as exc:  # a probe must return reasons; a raising one is broken
        if isinstance(exc, KeyboardInterrupt):
            out.append(("interrupt", exc))
            return
        out.append(("raised", plugin_failure(exc)))


def probe(
    spec: BackendSpec, problem: Problem, timeout: float, device: Any = None
) -> tuple[str, tuple[str, ...]]:
    """``(status, reasons)``: ``("eligible", ())``, ``("incompatible", reasons)`` or ``("broken", ...)``."""
    key = (spec.name, spec.loader, problem, str(device))
    with _lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    cls, why = load_class(spec, timeout)
    if cls is None:
        result: tuple[str, tuple[str, ...]] = ("broken", (why,))
    else:
        out: list[Any] = []
        worker = threading.Thread(
            target=_run, args=(cls, problem, device, out), daemon=True, name="arnorm-probe"
        )
        worker.start()
        worker.join(timeout)
        if not out:
            reason = (
                f"probe: no answer in {timeout:g} s (needs a probe that returns within "
                "ARNORM_PROBE_TIMEOUT; slow work such as JIT builds belongs in create())"
            )
            result = ("broken", (reason,))
        elif out[0][0] == "interrupt":
            raise out[0][1]
        elif out[0][0] == "raised":
            result = ("broken", (f"probe: raised {out[0][1]} (needs a probe that returns reasons)",))
        else:
            reasons = out[0][1]
            result = ("incompatible", reasons) if reasons else ("eligible", ())
    with _lock:
        _cache[key] = result
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return result
