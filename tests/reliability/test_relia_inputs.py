"""Bad call arguments on 2 and 4 gloo ranks: on every rank, or on one rank with and without check mode.

Every scenario runs in one spawn per world size (relia_harness): the outcome per rank is
``(call outcome, inputs unchanged, next good call paired)``.
"""

from __future__ import annotations

import pytest

import relia_harness as harness
import relia_inputs as ri

pytestmark = pytest.mark.slow

WORLDS = (2, 4)


def outcomes(world: int, name: str) -> list:
    return harness.outcomes(world, "relia_inputs", name)


def _cases(mode: str) -> list:
    out = []
    for kind in ri.KINDS:
        if f"{mode}:{kind}" not in ri.SCENARIOS:
            continue
        out.append(pytest.param(kind, id=kind))
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", _cases("all"))
def test_a_bad_argument_on_every_rank_is_the_same_local_error(world, kind):
    """Every rank rejects the same bad argument with the same message, writes nothing, stays paired."""
    outcome, unchanged, paired = harness.same_everywhere(outcomes(world, f"all:{kind}"))
    assert outcome[:2] == ("error", "InvalidInputError"), outcome
    assert outcome[2].startswith(ri.KINDS[kind][2]), outcome[2]
    assert unchanged and paired is True, (unchanged, paired)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", _cases("one_checked"))
def test_with_check_calls_a_bad_argument_on_one_rank_fails_every_rank_the_same_way(world, kind):
    """ARNORM_CHECK_CALLS=1: one rank's bad (or divergent) call raises the same error on every rank."""
    outcome, unchanged, paired = harness.same_everywhere(outcomes(world, f"one_checked:{kind}"))
    assert outcome[:2] == ("error", "InvalidInputError"), outcome
    message = outcome[2]
    assert message.startswith("calls: differ across ranks or were rejected (rank 0: call "), message
    if ri.KINDS[kind][2]:
        assert f"rank {world - 1}: " in message and f"rejected: {ri.KINDS[kind][2]}" in message, message
    assert unchanged and paired is True, (unchanged, paired)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", _cases("one_unchecked"))
def test_without_check_calls_a_rejection_on_one_rank_is_told_to_the_others(world, kind):
    """No check mode: the rejecting rank raises before any collective and writes nothing; its
    rejection fills the collective's slot (it cannot know whether the others made the call), so
    the next good call raises PeerError naming it on every rank, never pairing other steps' data
    (issue 41, item 2; this once said the rejection stayed local)."""
    results = outcomes(world, f"one_unchecked:{kind}")
    *others, last = results
    assert all(o[:2] == (("skipped",), True) for o in others), others
    outcome, unchanged, _ = last
    assert outcome[:2] == ("error", "InvalidInputError"), outcome
    assert outcome[2].startswith(ri.KINDS[kind][2]), outcome[2]
    assert unchanged
    told = f"PeerError: op out of step on rank {world - 1}: it rejected its call "  # 2 for w_swapped
    assert all(isinstance(p, str) and p.startswith(told) for _, _, p in results), results


@pytest.mark.parametrize("world", WORLDS)
def test_without_check_calls_a_one_rank_rejection_never_shifts_later_calls(world):
    """The hazard check mode once alone prevented: the others' call would pair with the rejecting
    rank's next one, with no error. Now the others raise PeerError naming the rejecting rank, every
    later call raises PeerError, and no rank returns a result."""
    results = outcomes(world, "shift_without_check")
    told = f"op out of step on rank {world - 1}: it rejected its call 1 before the collective"
    for rank, got in enumerate(results):
        assert not any(o[0] == "ok" for o in got), (rank, got)
        first, *later = got
        if rank == world - 1:
            assert first[:2] == ("error", "InvalidInputError"), first
        else:
            assert first[:2] == ("error", "PeerError") and first[2].startswith(told), first
        assert all(o[:2] == ("error", "PeerError") for o in later), (rank, later)
