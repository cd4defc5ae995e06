"""Calls that must never be torn between ranks (issue 41): a signal reaching a rank inside a call, a
call rejected on one rank only while the engine carries on, check mode's timeouts and interrupts,
and inference tensors at TP > 1. No rank may return a result computed from another step's data,
and every wait ends within the peer timeout with a clear error.
"""

from __future__ import annotations

import json

import faults_steps as fs
import pytest

from arnorm.testing import run_ranks

pytestmark = pytest.mark.slow

ENV = {"ARNORM_PEER_TIMEOUT": "3"}
CHECKED = {**ENV, "ARNORM_CHECK_CALLS": "1"}
RUN_S = 60.0


def _wrong(results) -> list:
    found = []

    def walk(item):
        if isinstance(item, tuple) and item[:2] == ("ok", False):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            for x in item:
                walk(x)

    walk(results)
    return found


# -- item 1 -----------------------------------------------------------------------------------------


def _result(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert lines, text
    return json.loads(lines[-1][7:])


@pytest.mark.parametrize("how", ["sigint", "sigterm"])
def test_a_signal_reaching_a_rank_inside_a_call_never_gives_its_peer_a_wrong_result(how):
    """Rank 1 waits inside call 2 when a SIGINT (or a SIGTERM its handler turns into SystemExit(7))
    reaches it: rank 0 raises PeerError (or gets the right result) within the bound, never a wrong
    one; rank 1 raises KeyboardInterrupt, or exits with its own code 7; no rank aborts."""
    (code0, out0), (code1, out1) = fs.launch(how, ENV)
    assert code0 == 0, out0
    got0, got1 = _result(out0), _result(out1)
    assert got0["first"] == got1["first"] == ["ok", True], (got0, got1)
    second = tuple(got0["second"])
    assert second == ("ok", True) or second[:2] == ("error", "PeerError"), (out0, out1)
    assert got0["waited"] < 10.0, got0
    if how == "sigint":
        assert code1 == 0, out1
        assert got1["second"] == ["interrupted", "KeyboardInterrupt"], out1
    else:
        assert code1 == 7, out1  # its own code: not -6 (SIGABRT inside gloo)
        assert got1["second"] == ["exit", 7], out1


# -- item 2 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_a_call_rejected_on_one_rank_only_never_pairs_steps(world):
    """Rank 1 rejects call 2 (a float64 weight) while the others make it, and every rank goes on
    calling without ARNORM_CHECK_CALLS: no rank ever returns a result from another step's data;
    the others raise PeerError naming rank 1, within the bound, and so do later calls."""
    results = run_ranks(world, fs.rejected_on_some_ranks, [1], env=ENV, timeout=RUN_S)
    assert not _wrong(results), results
    for rank, (got, waited) in enumerate(results):
        assert got[0] == ("ok", True), got
        if rank == 1:
            assert got[1][:2] == ("error", "InvalidInputError") and "weight: dtype" in got[1][2], got
        else:
            assert got[1][:2] == ("error", "PeerError") and "rank 1" in got[1][2], got
        assert all(o[:2] == ("error", "PeerError") for o in got[2:]), got
        assert waited < 3 * 3.0, waited


def test_a_call_rejected_on_every_rank_leaves_the_op_usable():
    """The same call rejected on every rank (the usual bad input): every rank raises it, and the
    op goes on working."""
    results = run_ranks(2, fs.rejected_on_some_ranks, [0, 1], env=ENV, timeout=RUN_S)
    for got, _ in results:
        assert got[0] == got[2] == got[3] == ("ok", True), got
        assert got[1][:2] == ("error", "InvalidInputError"), got


# -- item 6 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("inplace", [True, False])
def test_tensors_made_under_inference_mode_work_on_every_rank(inplace):
    results = run_ranks(2, fs.inference_tensors, inplace, env=ENV, timeout=RUN_S)
    assert results == [[("ok", True)] * 3] * 2, results


# -- item 14 ----------------------------------------------------------------------------------------


def test_check_mode_timeout_poisons_the_op():
    """Check mode: after one call timed out waiting for a stalled rank, the next call raises at
    once (PeerError), instead of waiting the whole peer timeout again."""
    results = run_ranks(2, fs.checked_timeout_then_call_again, 9.0, env=CHECKED, timeout=RUN_S)
    first, second, third, t_second, t_third = results[0]
    assert first == ("ok", True)
    assert second[:2] == ("error", "PeerError") and "rank 1" in second[2], second
    assert third[:2] == ("error", "PeerError"), third
    assert t_third < 1.0, (t_second, t_third)


def test_check_mode_interrupt_leaves_a_note():
    """Check mode: rank 1 is interrupted while it waits in call 2's agreement; rank 0, arriving
    later, raises PeerError naming the interrupt at once, not after the peer timeout (10 s here)."""
    env = {"ARNORM_PEER_TIMEOUT": "10", "ARNORM_CHECK_CALLS": "1"}
    results = run_ranks(2, fs.checked_interrupt, 2.0, env=env, timeout=RUN_S)
    (first0, second0, waited0), (first1, second1) = results
    assert first0 == first1 == ("ok", True)
    assert second1 == ("interrupted", "KeyboardInterrupt"), second1
    assert second0[:2] == ("error", "PeerError") and "KeyboardInterrupt" in second0[2], second0
    # The note names the call that was interrupted, as it does outside check mode.
    assert "rank 1: its call 2 failed with KeyboardInterrupt" in second0[2], second0
    assert waited0 < 5.0, waited0
