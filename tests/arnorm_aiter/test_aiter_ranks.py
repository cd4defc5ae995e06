"""Several CPU ranks over gloo with the fake installed in each: the real Comm, agreement, and the op."""

from __future__ import annotations

import pytest

from arnorm.testing import run_ranks

pytestmark = pytest.mark.slow

CASES = [
    {"tokens": 5, "hidden_size": 1024},
    {"tokens": 96, "hidden_size": 1024, "weight_offset": 1.0},
    {"tokens": 7, "hidden_size": 1024, "dtype": "float16", "inplace": False},
    {"tokens": 5, "hidden_size": 1024, "quant": "fp8_per_token", "weight_offset": 1.0},
    {"tokens": 100, "hidden_size": 1024, "quant": "fp8_per_token", "normed_output": False, "inplace": False},
]


def test_backend_matches_the_reference_within_tolerance():
    results = run_ranks(4, _fn("rank_backend_vs_reference"), CASES)
    for rank, per_case in enumerate(results):
        for case, (dev, problems) in zip(CASES, per_case, strict=True):
            assert problems == [], f"rank {rank} {case}: {dev}"


def test_allreducenorm_selects_aiter():
    results = run_ranks(2, _fn("rank_through_op"), [(None, 1.0), ("fp8_per_token", 0.0)])
    for per_rank in results:
        for backend, explanation, problems in per_rank:
            assert backend == "aiter"
            assert "aiter" in explanation and "selected" in explanation
            assert problems == []


def _fn(name):
    import aiter_fake

    return getattr(aiter_fake, name)
