"""Faults between ranks (docs/troubleshooting.md, "When a rank fails"): a rank that raises, stalls,
forks, races or builds out of order makes every rank raise a clear error, within a bound, and never
return a wrong result.

Each test runs 2-3 gloo ranks under ``run_ranks``'s timeout: a hang fails the test (RankError)
instead of blocking CI. ``ARNORM_PEER_TIMEOUT`` is short here so the bounded waits end fast.
"""

from __future__ import annotations

import faults_fixtures as ff
import pytest

from arnorm.testing import run_ranks

pytestmark = pytest.mark.slow

#: Seconds a rank waits for its peers in these tests (the library's default is minutes).
PEER_TIMEOUT = "3"
ENV = {"ARNORM_PEER_TIMEOUT": PEER_TIMEOUT}
CHECKED = {**ENV, "ARNORM_CHECK_CALLS": "1"}
#: The whole run's bound: a rank that hangs fails the test within this many seconds.
RUN_S = 45.0


def outcomes(results):
    """Every call's outcome tuple, whatever the nesting."""
    for item in results:
        if isinstance(item, tuple):
            yield item
        elif isinstance(item, list):
            yield from outcomes(item)


def assert_never_wrong(results):
    wrong = [o for o in outcomes(results) if o[:2] == ("ok", False)]
    assert not wrong, f"a rank returned a wrong result: {results}"


@pytest.mark.parametrize(
    ("backend", "env", "world"),
    # triton on CPU ops runs in the interpreter, also on a host with GPUs (the ranks' ops are CPU ops).
    [("reference", ENV, 2), ("reference", CHECKED, 3), ("triton", {**ENV, "TRITON_INTERPRET": "1"}, 2)],
    ids=["reference", "reference-checked-3ranks", "triton"],
)
def test_a_rank_whose_call_raised_poisons_the_op_on_every_rank(backend, env, world):
    """Rank 1's backend raises MemoryError in call 3 and the engine goes on calling: no rank ever
    pairs call 3 with call 4; the peers raise PeerError at once, every later call raises the same
    message on every rank, and a new op works."""
    fail_at, calls = 3, 5
    results = run_ranks(world, ff.raise_once_then_continue, backend, fail_at, calls, env=env, timeout=RUN_S)
    assert_never_wrong(results)
    for rank, got in enumerate(results):
        assert got[: fail_at - 1] == [("ok", True)] * (fail_at - 1), got
        assert got[-1] == ("ok", True), got  # a new op pairs up again
        failed = got[fail_at - 1]
        if rank == 1:
            assert failed[:2] == ("error", "MemoryError"), failed
        else:
            assert failed[:2] == ("error", "PeerError"), failed
            assert "rank 1" in failed[2] and "MemoryError" in failed[2], failed
    later = {o for r in results for o in r[fail_at:calls]}
    assert len(later) == 1, later  # the same error on every rank, every later call
    (_kind, name, message) = later.pop()
    assert name == "PeerError"
    assert message.startswith("op out of step on rank 1: its call 3 failed with MemoryError"), message
    assert "build a new op" in message


def test_a_call_that_failed_after_its_collective_is_named_by_its_own_number():
    """Rank 1 fails call 3 after its collective: the peers' call 3 completed, their call 4 raises,
    and every message names call 3 (the failed call knows whether it reached its collective)."""
    results = run_ranks(2, ff.raise_after_the_collective, 3, 5, env=ENV, timeout=RUN_S)
    assert_never_wrong(results)
    zero, one = results
    assert zero[:3] == [("ok", True)] * 3 and one[:2] == [("ok", True)] * 2, results
    assert one[2][:2] == ("error", "MemoryError"), one
    for o in zero[3:] + one[3:]:
        assert o[:2] == ("error", "PeerError"), results
        assert o[2].startswith("op out of step on rank 1: its call 3 failed with MemoryError"), o


def test_two_ops_on_one_group_from_two_threads_never_interleave():
    """Two ops on one TP group, each called from its own thread: clear errors, never a wrong result."""
    results = run_ranks(2, ff.two_ops_two_threads, 20, env=ENV, timeout=RUN_S)
    assert_never_wrong(results)
    errors = [o for o in outcomes(results) if o[0] == "error"]
    assert errors, results
    assert all(o[1] == "InvalidInputError" and "thread" in o[2] for o in errors), errors
    assert results[0] == results[1]  # the same rule on every rank


def test_an_extra_op_built_on_one_rank_while_the_other_calls_is_a_clear_error():
    """Rank 1 builds an op while rank 0 calls: both raise PeerError within the peer timeout, and
    building again afterwards works on both."""
    results = run_ranks(2, ff.extra_op_while_calling, env=ENV, timeout=RUN_S)
    assert_never_wrong(results)
    (first0, second0, third0), (first1, second1, third1) = results
    assert first0 == first1 == ("ok", True)
    assert second0[:2] == ("error", "PeerError") and "rank 1" in second0[2], second0
    assert second1[:2] == ("error", "PeerError") and "rank 0" in second1[2], second1
    assert third0 == third1 == ("ok", True)


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_stalled_before_a_call_ends_its_peers_wait_within_the_bound(world):
    """Rank 1 stalls; every other rank raises PeerError naming rank 1 (and only rank 1)."""
    results = run_ranks(world, ff.stall_before_call, 7.0, env=ENV, timeout=RUN_S)
    for rank, got in enumerate(results):
        if rank == 1:
            continue
        first, second, waited = got
        assert first == ("ok", True)
        assert second[:2] == ("error", "PeerError"), second
        assert "peers: rank 1 did not join call 2" in second[2] and "peer_timeout" in second[2], second
        assert waited < 6.5


def test_a_rank_stalled_before_construction_ends_its_peers_wait_within_the_bound():
    results = run_ranks(2, ff.stall_in_construction, 7.0, env=ENV, timeout=RUN_S)
    got, waited = results[0]
    assert got[:2] == ("error", "PeerError"), got
    assert "rank 1" in got[2] and "peer_timeout" in got[2], got
    assert waited < 6.5


def test_ranks_passing_different_group_objects_raise_before_any_data_collective():
    """WORLD on rank 0, a new_group of the same ranks on rank 1: the same clear error, at once."""
    results = run_ranks(2, ff.different_group_objects, env=ENV, timeout=RUN_S)
    (got0, waited0), (got1, _) = results
    assert got0 == got1, results
    assert got0[:2] == ("error", "InvalidInputError") and "tp_group" in got0[2], got0
    assert waited0 < 2.0


def test_a_forked_child_calling_its_parents_op_raises_at_once():
    results = run_ranks(2, ff.forked_child_calls, env=ENV, timeout=RUN_S)
    for first, in_child, after, _ in results:
        assert first == after == ("ok", True)
        assert in_child is not None, "the child hung"
        assert in_child[:2] == ("error", "PeerError") and "fork" in in_child[2], in_child


@pytest.mark.parametrize("where", ["probe", "_build"])
def test_a_keyboard_interrupt_in_construction_leaves_every_rank_able_to_build(where):
    results = run_ranks(2, ff.interrupted_construction, where, env=ENV, timeout=RUN_S)
    assert_never_wrong(results)
    assert results[1][0] == ("interrupted",)
    first0 = results[0][0]
    assert first0[:2] == ("error", "PeerError") and "KeyboardInterrupt" in first0[2], first0
    for got in results:
        assert got[1:] == [("ok", True), ("ok", True)], got


def test_fused_over_its_budget_on_one_rank_with_check_calls_is_one_clear_error():
    results = run_ranks(2, ff.fused_over_budget_on_one_rank, env=CHECKED, timeout=RUN_S)
    assert_never_wrong(results)
    for got in results:
        assert got[0] == ("ok", True)
        assert got[1][:2] == ("error", "InvalidInputError") and "calls: differ across ranks" in got[1][2]
        assert got[2:] == [("ok", True), ("ok", True)], got
    assert results[0][1] == results[1][1]


def test_fused_allreduce_norm_from_two_threads_names_itself():
    results = run_ranks(2, ff.fused_from_two_threads, 10, env=ENV, timeout=RUN_S)
    assert_never_wrong(results)
    errors = [o for o in outcomes(results) if o[0] == "error"]
    assert all(o[1] == "InvalidInputError" and "fused_allreduce_norm" in o[2] for o in errors), errors


def test_fused_allreduce_norm_rebuilds_its_op_after_a_failed_call():
    """The helper's cached op is poisoned on every rank by rank 1's failure; its next call builds a
    new op on every rank and the results are right again."""
    results = run_ranks(2, ff.fused_recovers_after_a_failed_call, env=ENV, timeout=RUN_S)
    assert_never_wrong(results)
    (a0, b0, c0, d0), (a1, b1, c1, d1) = results
    assert a0 == a1 == ("ok", True)
    assert b1[:2] == ("error", "MemoryError") and b0[:2] == ("error", "PeerError"), (b0, b1)
    assert c0 == c1 == d0 == d1 == ("ok", True)
