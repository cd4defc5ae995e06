"""Conformance case ids: what a failure list shows, in the words Problem.short() uses."""

from __future__ import annotations

import pytest

from arnorm._norm import NORM_OPTIONS
from arnorm.testing._cases import Case


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (Case(4, 64, "bfloat16", None, None, 0.0), "bfloat16-none-T4-H64-plain"),
        (Case(4, 64, "bfloat16", "fp8_static", None, 1.0), "bfloat16-fp8_static-T4-H64-gemma"),
        (
            Case(8, 128, "float16", "mxfp8", "swizzled", 0.5, frozenset({"round_before_weight"}), False),
            "float16-mxfp8/swizzled-T8-H128-offset=0.5-round-before-weight-no-residual",
        ),
        (
            Case(4, 64, "bfloat16", None, None, 1.0, frozenset(NORM_OPTIONS)),
            "bfloat16-none-T4-H64-gemma-round-before-weight-unrounded",
        ),
        (
            Case(2, 64, "float32", None, None, 0.0, inplace=False, normed_output=False, strided=True),
            "float32-none-T2-H64-plain-not-inplace-no-normed-output-strided",
        ),
    ],
)
def test_case_ids_read_as_words(case, expected):
    """No letter codes (``b1``, ``rbw``, ``nores``): a plugin author reads a failure without the source."""
    assert case.id == expected


def test_the_suite_builds_cases_for_every_declared_format_and_layout():
    """The conformance cases and the invariance cases cover every (format, layout) the backend
    declares, each at a hidden size the backend admits (the one rule of registry._capabilities)."""
    from arnorm._formats import FORMAT_SPECS
    from arnorm.registry._capabilities import hidden_multiple
    from arnorm.testing import ConformanceSuite
    from arnorm.testing._invariance import invariance_cases

    class Reference(ConformanceSuite):
        backend = "reference"

    caps = Reference.spec().capabilities
    want = {
        (None if q == "none" else q, layout)
        for q in caps.quant
        for layout in (FORMAT_SPECS[q].layouts if q != "none" else ()) or (None,)
    }
    assert len(want) == 23  # "none" and every format with each of its layouts (the reference serves all)
    assert {(c.quant, c.layout) for c in Reference.cases()} == want
    # Invariance is a property of rows, not of storage: each format and each layout once.
    invariance = {(c.quant, c.layout) for c in invariance_cases(caps, 100)}
    assert {q for q, _ in invariance} == {q for q, _ in want}
    assert {lay for _, lay in invariance} == {lay for _, lay in want}
    for cases in (Reference.cases(), invariance_cases(caps, 100)):
        assert all(c.hidden % hidden_multiple(caps, c.quant or "none") == 0 for c in cases)
    for cases in (Reference.cases(), invariance_cases(caps, 100)):
        # The reference serves every option: each is on in some case, and in the conformance sweep
        # all of them together too.
        assert set().union(*(c.norm_options for c in cases)) == set(NORM_OPTIONS)
    assert any(c.norm_options == set(NORM_OPTIONS) for c in Reference.cases())


def test_declared_options_rotate_over_the_shapes():
    """Conformance: the k-th declared option on at shape i when i + k is odd, all at the last shape;
    invariance: the k-th alone in case 2k + 1. A backend declaring none gets none."""
    from arnorm.plugin import Capabilities
    from arnorm.testing._invariance import invariance_cases

    both = Capabilities(platforms={"cpu"}, quant={"none", "fp8_static", "fp8_per_token", "mxfp8"},
                        norm_options=set(NORM_OPTIONS))  # fmt: skip
    got = [c.norm_options for c in invariance_cases(both, 64)]
    assert got == [set(), {"round_before_weight"}, set(), {"normalize_unrounded"}, set()]
    none = both.model_copy(update={"norm_options": frozenset()})
    assert all(not c.norm_options for c in invariance_cases(none, 64))
