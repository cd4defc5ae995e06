"""Agreement over the store (arnorm.comm._rendezvous): a rank that arrives after its peers gave up."""

from __future__ import annotations

import comm_ranks
import pytest

from arnorm.testing import run_ranks

pytestmark = pytest.mark.slow

ENV = {"ARNORM_PEER_TIMEOUT": "2"}


@pytest.mark.parametrize("subgroup", [True, False], ids=["subgroup", "world"])
def test_a_rank_late_for_construction_after_its_peers_timed_out_gets_peer_error(subgroup):
    """The late rank used to pass the agreement on its peer's stale key and fail in the data
    communicator's rendezvous with torch's raw DistStoreError, after the timeout. Now PeerError at
    once, naming the rank that gave up (by global rank) and when."""
    world = 3 if subgroup else 2
    results = run_ranks(world, comm_ranks.late_after_peers_timed_out, subgroup, env=ENV, timeout=90)
    peer = results[1] if subgroup else results[0]
    assert peer[:2] == ("error", "PeerError"), peer
    (kind, name, message), took = results[-1]
    assert (kind, name) == ("error", "PeerError"), (kind, name, message)
    gave_up = "rank 1 [group rank 0]" if subgroup else "rank 0"
    group = "[1, 2]" if subgroup else "[0, 1]"
    assert message.startswith(f"peers: {gave_up} gave up on building op #1 on group {group} at "), message
    assert " UTC, " in message and "s before this rank arrived" in message, message
    assert took < 1.5, took  # at once, not after another timeout


def test_messages_on_a_subgroup_name_global_ranks_with_their_group_position():
    """Construction, check-mode calls and a call one rank rejected, on the subgroup [1, 2]: every
    message names global ranks ("rank 2 [group rank 1]"), never a bare group position."""
    results = run_ranks(3, comm_ranks.subgroup_messages, env=ENV, timeout=120)
    got = results[1]
    kind, name, message = got["construction"]
    assert (kind, name) == ("error", "InvalidInputError"), got
    assert "(rank 1 [group rank 0]: hidden_size=8; rank 2 [group rank 1]: hidden_size=16)" in message, message
    kind, name, message = got["check_calls"]
    assert (kind, name) == ("error", "InvalidInputError"), got
    assert "rank 1 [group rank 0]: call 1, hidden_states " in message, message
    assert "; rank 2 [group rank 1]: call 1, hidden_states " in message, message
    kind, name, message = got["rejected"]
    assert (kind, name) == ("error", "PeerError"), got
    assert message.startswith("op out of step on rank 2 [group rank 1]: it rejected its call 1"), message
    assert results[2]["rejected"][:2] == ("error", "InvalidInputError"), results[2]


@pytest.mark.slow
def test_one_gather_agreements_in_a_row_pair_round_by_round():
    """A rank that completed a one-gather agreement (fuse(), vLLM's routing check) and began the
    next while its peer had not yet looked at the first: the peer took it for drift, joined the
    next build with the first round's data, and both then paired the wrong rounds (or timed out).
    Each round now pairs with itself."""
    results = run_ranks(2, comm_ranks.one_gather_agreements_in_a_row, 3, env=ENV, timeout=90)
    want = [("ok", [f"round {i} rank 0", f"round {i} rank 1"]) for i in range(3)]
    assert results == [want, want], results
