"""arnorm.registry._imports: plugin imports bounded in time, never started twice while one is running."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from arnorm._config import MAX_TIMEOUT
from arnorm.registry._imports import discovery_timeout, import_bounded, timed_out

#: What the gated module waits for (the test releases it, so no thread outlives the test).
GATE = threading.Event()


@pytest.fixture
def gated_module(tmp_path, monkeypatch):
    """A module whose import blocks until GATE is set; released and forgotten afterwards."""
    name = f"imports_gated_{time.monotonic_ns()}"
    (tmp_path / f"{name}.py").write_text("import test_imports\n\ntest_imports.GATE.wait()\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    GATE.clear()
    yield name
    GATE.set()
    sys.modules.pop(name, None)


def _import_threads() -> int:
    return sum(t.name == "arnorm-import" for t in threading.enumerate())


def test_an_import_that_does_not_return_times_out_once_and_is_never_started_again(gated_module):
    """The first request waits its timeout; later ones answer at once from the same running import
    (a second import of the module would only wait on its import lock), with one thread in all;
    once the import returns, its module is the answer."""
    before = _import_threads()
    start = time.monotonic()
    assert import_bounded(gated_module, 0.3) == ("timeout", None)
    assert 0.25 <= time.monotonic() - start < 5
    start = time.monotonic()
    assert import_bounded(gated_module, 0.3) == ("timeout", None)
    assert time.monotonic() - start < 0.25
    assert _import_threads() == before + 1
    GATE.set()
    status, module = import_bounded(gated_module, 5)
    assert status == "ok" and module.VALUE == 7
    assert import_bounded(gated_module, 5) == ("ok", module)


def test_an_import_that_raises_hands_back_the_exception(tmp_path, monkeypatch):
    """Anything the module raises, SystemExit included, comes back as ("raised", exc)."""
    (tmp_path / "imports_exits.py").write_text("raise SystemExit('no driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, exc = import_bounded("imports_exits", 5)
    assert status == "raised" and isinstance(exc, SystemExit) and exc.code == "no driver"


def test_the_reason_and_the_discovery_bound(monkeypatch):
    """The reason follows the grammar; discovery reads ARNORM_PROBE_TIMEOUT, falling back to 15 s for
    a value Config would refuse (it says so itself)."""
    assert timed_out(2).startswith("import: no answer in 2 s, still running (needs a module ")
    for value, expected in (("2", 2.0), ("0", 15.0), ("1e10", 15.0), ("nan", 15.0), ("x", 15.0)):
        monkeypatch.setenv("ARNORM_PROBE_TIMEOUT", value)
        assert discovery_timeout() == expected
    monkeypatch.setenv("ARNORM_PROBE_TIMEOUT", str(MAX_TIMEOUT))
    assert discovery_timeout() == MAX_TIMEOUT
