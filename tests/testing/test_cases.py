"""Conformance case ids: what a failure list shows, in the words Problem.short() uses."""

from __future__ import annotations

import pytest

from arnorm.testing._cases import Case


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (Case(4, 64, "bfloat16", None, None, 0.0), "bfloat16-none-T4-H64-plain"),
        (Case(4, 64, "bfloat16", "fp8_static", None, 1.0), "bfloat16-fp8_static-T4-H64-gemma"),
        (
            Case(8, 128, "float16", "mxfp8", "swizzled", 0.5, True, False),
            "float16-mxfp8/swizzled-T8-H128-offset=0.5-round-before-weight-no-residual",
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
