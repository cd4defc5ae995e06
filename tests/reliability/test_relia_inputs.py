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
    assert outcome[:2] == ("raised", "InvalidInputError"), outcome
    assert outcome[2].startswith(ri.KINDS[kind][2]), outcome[2]
    assert unchanged and paired is True, (unchanged, paired)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", _cases("one_checked"))
def test_with_check_calls_a_bad_argument_on_one_rank_fails_every_rank_the_same_way(world, kind):
    """ARNORM_CHECK_CALLS=1: one rank's bad (or divergent) call raises the same error on every rank."""
    outcome, unchanged, paired = harness.same_everywhere(outcomes(world, f"one_checked:{kind}"))
    assert outcome[:2] == ("raised", "InvalidInputError"), outcome
    message = outcome[2]
    assert message.startswith("calls: differ across ranks or were rejected (rank 0: call "), message
    if ri.KINDS[kind][2]:
        assert f"rank {world - 1}: " in message and f"rejected: {ri.KINDS[kind][2]}" in message, message
    assert unchanged and paired is True, (unchanged, paired)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", _cases("one_unchecked"))
def test_without_check_calls_a_rejection_on_one_rank_stays_local(world, kind):
    """No check mode: the rejecting rank raises before any collective, so the next calls still pair."""
    results = outcomes(world, f"one_unchecked:{kind}")
    *others, last = results
    assert all(o == (("skipped",), True, True) for o in others), others
    outcome, unchanged, paired = last
    assert outcome[:2] == ("raised", "InvalidInputError"), outcome
    assert outcome[2].startswith(ri.KINDS[kind][2]), outcome[2]
    assert unchanged and paired is True, (unchanged, paired)


@pytest.mark.parametrize("world", WORLDS)
def test_without_check_calls_a_one_rank_rejection_shifts_later_calls_silently(world):
    """Documented hazard: the others' call pairs with the rejecting rank's next one, no error anywhere."""
    results = outcomes(world, "shift_without_check")
    for rank, (errors, correct, shifted) in enumerate(results):
        expected_errors = 1 if rank == world - 1 else 0
        assert len(errors) == expected_errors and all(e[1] == "InvalidInputError" for e in errors)
        assert (correct, shifted) == (False, True), (rank, correct, shifted)
