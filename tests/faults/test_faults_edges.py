"""Faults at the edges of the store and of subgroups (issue 41, items 5, 10 and 13): the store
host going away, timeouts on a subgroup naming global ranks, and the store's key count over
many ops. Each test runs 2-4 gloo ranks under ``run_ranks``'s timeout."""

from __future__ import annotations

import faults_edges as fe
import pytest

from arnorm.testing import run_ranks

pytestmark = pytest.mark.slow

ENV = {"ARNORM_PEER_TIMEOUT": "3"}


def test_the_store_keeps_no_keys_of_ops_every_rank_closed_or_dropped():
    """1,000 ops built and closed (or dropped) used to leave 4 keys each in the c10d store."""
    results = run_ranks(2, fe.store_keys_over_ops, 1000, 100, env=ENV, timeout=300)
    for outcomes, before, after in results:
        assert outcomes == [("ok", True)], outcomes
        assert after <= before + 2, (before, after)


@pytest.mark.parametrize(
    ("where", "what"),
    [
        ("construction", "did not reach building op #1 on group [1, 2]"),
        ("call", "did not join call 2 of op #1"),
    ],
)
def test_a_timeout_on_a_subgroup_names_the_late_rank_by_its_global_rank(where, what):
    """Global rank 2 is late on the subgroup [1, 2]: the error names rank 2 (group rank 1), not
    "rank 1", which reads as the rank that raised."""
    results = run_ranks(3, fe.stall_on_subgroup, where, env=ENV, timeout=60)
    kind, name, message = results[1]
    assert (kind, name) == ("error", "PeerError"), results[1]
    assert f"peers: rank 2 [group rank 1] {what}" in message, message
    assert "rank 1 " not in message.replace("[group rank 1]", ""), message


@pytest.mark.parametrize("check_calls", [False, True], ids=["default", "check-calls"])
def test_a_store_whose_host_died_is_a_clear_error_on_every_rank(check_calls):
    """The store's host dies: building (and calling in check mode) used to raise a raw
    DistNetworkError: Broken pipe. Now StoreLostError (a PeerError) says so and what to do, at
    once; a call outside check mode does not use the store and still works."""
    import arnorm

    results = run_ranks(2, fe.store_host_dies, check_calls, env=ENV, timeout=90)
    for first, (call, call_s), (build, build_s) in results:
        assert first == ("ok", True)
        if check_calls:
            assert call[:2] == ("error", "StoreLostError"), call
            assert call[2].startswith("store: gone while calling op #1 on group [0, 1] (DistNetworkError: ")
        else:
            assert call == ("ok", True), call
        assert build[:2] == ("error", "StoreLostError"), build
        assert build[2].startswith("store: gone while building op #2 on group [0, 1] (DistNetworkError: ")
        assert "(needs a live c10d store: " in build[2] and "restart the job" in build[2], build
        assert call_s < 2.5 and build_s < 2.5  # at once, not at the peer timeout
    assert issubclass(arnorm.StoreLostError, arnorm.PeerError)


def test_a_peer_that_raised_the_agreed_error_and_began_again_is_not_taken_for_drift():
    """Rank 0 raises the error every rank raises, then begins its next build before rank 1 has
    looked at the first: rank 1 used to take rank 0's new build for a drifted count and jump to it,
    so its own second attempt waited for an op rank 0 never built (PeerError after the timeout)."""
    results = run_ranks(2, fe.refused_twice_with_rank1_slow_to_look, env=ENV, timeout=60)
    for first, second, third in results:
        assert first[:2] == second[:2] == ("error", "InvalidInputError"), (first, second)
        assert "quant" in first[2] and first == second
        assert third == ("ok", None)
    assert results[0] == results[1]
