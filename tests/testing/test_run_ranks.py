"""arnorm.testing.run_ranks: results in rank order, and a dead rank ends the run within seconds."""

from __future__ import annotations

import time

import pytest
import testing_rank_fns as fns

from arnorm.testing import RankError, run_ranks

pytestmark = pytest.mark.slow

#: Far above what any of these runs takes when a failure is noticed: a run that waited it out failed.
TIMEOUT = 300.0
#: Starting two ranks takes under a second from the fork server, a few seconds spawned (longer on a
#: loaded CI machine).
NOTICED_WITHIN = 60.0


def _fails_fast(fn, *args, **kw) -> str:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(2, fn, *args, timeout=TIMEOUT, **kw)
    elapsed = time.monotonic() - start
    assert elapsed < NOTICED_WITHIN, f"noticed after {elapsed:.0f} s (timeout {TIMEOUT:g} s)"
    assert not info.value.timed_out  # a rank failed: not the timeout
    return str(info.value)


def test_results_come_back_in_rank_order():
    """Each rank's return value comes back, indexed by rank, with per-rank environments applied."""
    assert run_ranks(2, fns.rank_and_world, "x", timeout=TIMEOUT) == [(0, 2, "x"), (1, 2, "x")]


def test_ranks_see_the_callers_environment_and_path_as_they_are_at_the_call(monkeypatch, tmp_path):
    """The ranks start from a fork server that imported torch once (where the platform has one),
    yet see what a spawned process would: the caller's environment and ``sys.path`` at the call
    (set or removed after the server started), then ``env``."""
    import multiprocessing

    monkeypatch.setenv("ARNORM_TEST_GONE", "set when the server started")
    run_ranks(2, fns.rank_and_world, timeout=TIMEOUT)  # the server runs from here on
    monkeypatch.setenv("ARNORM_TEST_LATE", "set after")
    monkeypatch.delenv("ARNORM_TEST_GONE")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["ARNORM_TEST_LATE", "ARNORM_TEST_GONE", "ARNORM_TEST_RANK"]
    env = [{"ARNORM_TEST_RANK": str(r)} for r in range(2)]
    got = run_ranks(2, fns.environment_and_path, names, str(tmp_path), env=env, timeout=TIMEOUT)
    preloaded = "forkserver" in multiprocessing.get_all_start_methods()
    assert got == [(("set after", None, str(r)), True, preloaded) for r in range(2)]


def test_a_ranks_exit_handlers_run_when_it_ends(tmp_path):
    """Exit handlers registered in a rank run when it ends, as at a spawned interpreter's exit
    (arnorm's closes the ops an engine left open), although fork-server processes end in os._exit."""
    run_ranks(2, fns.register_exit_writer, str(tmp_path / "exit"), timeout=TIMEOUT)
    assert [(tmp_path / f"exit.{r}").read_text() for r in range(2)] == ["0", "1"]


def test_exception_on_one_rank_fails_fast_with_its_traceback():
    """A rank that raises ends the run at once with its traceback, while its peer is stuck in a barrier."""
    text = _fails_fast(fns.fail_on_rank_one)
    assert text.startswith("rank 1 failed")
    assert "--- rank 1 ---" in text and "Traceback" in text and "ValueError: rank one gives up" in text
    assert "--- rank 0 " in text  # it failed in the barrier too, or was stopped


def test_import_error_on_one_rank_fails_fast_with_its_traceback():
    """A module that fails to import on one rank is reported with that rank's ImportError traceback."""
    env = [{}, {"TESTING_RANK_FNS_BREAK_IMPORT": "1"}]
    text = _fails_fast(fns.rank_and_world, env=env)
    assert "--- rank 1 ---" in text and "ImportError: testing_rank_fns: broken on purpose" in text


def test_bootstrap_error_fails_fast():
    """A process group that cannot be created (unknown backend) fails every rank fast, with the error."""
    text = _fails_fast(fns.rank_and_world, backend="no_such_backend")
    assert "--- rank 0 ---" in text and "no_such_backend" in text


def test_silent_exit_is_reported_with_exit_code():
    """A rank that exits without sending a result is reported with its exit code."""
    text = _fails_fast(fns.exit_on_rank_one)
    assert text.startswith("rank 1 failed")
    assert "--- rank 1 exited with code 3 without sending a result ---" in text


def test_segfault_is_reported_with_signal_and_faulthandler_trace():
    """A rank killed by a signal is named with the signal and faulthandler's Python traceback."""
    text = _fails_fast(fns.segfault_on_rank_one)
    assert text.startswith("rank 1 failed")
    assert "--- rank 1 was killed by SIGSEGV without sending a result ---" in text
    assert "segfault_on_rank_one" in text


def test_unpicklable_result_is_an_error_of_that_rank():
    """A return value that does not pickle is that rank's error, not a hang or a silent exit."""
    text = _fails_fast(fns.unpicklable_result)
    assert "--- rank 0 ---" in text and "pickle" in text.lower()


def test_hung_rank_fails_at_the_timeout_argument():
    """A rank that never answers fails the run when run_ranks' own timeout argument runs out."""
    run_ranks(2, fns.rank_and_world, timeout=TIMEOUT)  # the fork server is up: ranks start at once
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] did not finish within 6 s") as info:
        run_ranks(2, fns.sleep_on_rank_one, timeout=6)
    assert time.monotonic() - start < NOTICED_WITHIN
    assert "--- rank 1 was still running and was stopped ---" in str(info.value)
    assert info.value.timed_out


def test_unpicklable_function_is_rejected_before_spawning():
    """A lambda cannot reach the ranks: a TypeError says what is needed, before any process starts."""
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(2, lambda rank, world: None)
