"""Hypothesis fuzz at TP 2 and 4 against the independent float64 oracle (relia_oracle), on the
``reference`` backend and on ``triton`` in the Triton interpreter.

Shapes, dtypes, formats and scale layouts, weight offsets (Gemma's 1, plain 0, arbitrary), eps,
rounding order, in place or not, with or without the normed output, input magnitudes, all-zero
rows, saturating input scales and (reference) strided rows. Spawning ranks is the slow part, so
hypothesis draws the cases in the test process first (its generation phase alone: varied cases
and edge values, no spawn per example) and one spawn checks them all (relia_fuzz_ranks). There is
no shrinking (each step would be a spawn): a failure prints every failing case in full, and a case
is deterministic (its seed makes the tensors), so it reproduces as it is. The quantized outputs
are compared with the oracle's own quantizers applied to the op's normed output (those
quantizers agree with arnorm.quant bit for bit: test_relia_oracle.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from arnorm.testing import run_ranks

import relia_fuzz_ranks
from relia_harness import triton_unavailable

pytestmark = pytest.mark.slow

QUANTS = [None, "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"]
BLOCK = {"nvfp4": 16, "mxfp8": 32}


@st.composite
def cases(draw, small: bool) -> dict:
    """One case; ``small`` keeps the Triton interpreter fast (a few tokens, narrow rows)."""
    quant = draw(st.sampled_from(QUANTS))
    block = BLOCK.get(quant)
    if block:
        hidden = block * draw(st.integers(1, 2 if small else 4))
    else:
        hidden = draw(st.integers(1, 48 if small else 160))
    tokens = draw(st.integers(1, 4) if small else st.integers(1, 6) | st.sampled_from([127, 128, 129]))
    return {
        "seed": draw(st.integers(0, 2**31 - 1)),
        "dtype": draw(st.sampled_from(["bfloat16", "float16", "float32"])),
        "tokens": tokens,
        "spare_tokens": draw(st.integers(0, 3)),
        "hidden": hidden,
        "quant": quant,
        "layout": draw(st.sampled_from([None, "linear", "swizzled_128x4"])) if block else None,
        "offset": draw(st.sampled_from([0.0, 1.0]) | st.floats(-2.0, 2.0, width=32)),
        "eps": draw(st.sampled_from([1e-6, 1e-5]) | st.floats(1e-8, 1.0)),
        "round_before_weight": draw(st.booleans()),
        "inplace": draw(st.booleans()),
        "normed_output": draw(st.booleans()) if quant else True,
        # Partials and residual ~ N(0, magnitude^2); weights ~ N(mean, 0.01): with offset 1 and
        # mean -1 the factor (offset + weight) cancels to a few ulps.
        "magnitude": draw(st.sampled_from([1e-3, 1.0, 30.0])),
        "weight_mean": draw(st.sampled_from([0.0, 1.0, -1.0])),
        "scale_factor": draw(st.sampled_from([0.25, 1.0, 8.0])),
        "zero_row": draw(st.booleans()),
        "strided": False if small else draw(st.booleans()),
    }


def draw(strategy: st.SearchStrategy, n: int) -> list:
    """``n`` examples of ``strategy`` from hypothesis's generation phase (in this process, no spawn)."""
    drawn: list = []

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def collect(example):
        drawn.append(example)

    collect()
    return drawn


def check(world: int, drawn: list[dict], backend: str, env: dict[str, str] | None = None) -> None:
    failures = run_ranks(world, relia_fuzz_ranks.run_cases, drawn, backend, env=env, timeout=90)
    found = {(rank, i): why for rank, per_rank in enumerate(failures) for i, why in per_rank}
    assert not found, (
        f"{len(found)} (rank, case) pairs of {len(drawn)} cases x {world} ranks off the contract:\n"
        + "\n".join(
            f"  rank {rank}, case {i}: {why}\n    {drawn[i]}" for (rank, i), why in sorted(found.items())[:20]
        )
    )


@pytest.mark.parametrize(("world", "n"), [(2, 64), (4, 40)])
def test_reference_meets_the_contract_on_random_cases(world, n):
    """64 / 40 random cases at TP 2 / 4: residual bitwise, normed within the interval, quant bitwise."""
    check(world, draw(cases(small=False), n), "reference")


@pytest.mark.parametrize(
    ("world", "exact"),
    [(2, True), (4, True), (2, False)],
    ids=["tp2-exact", "tp4-exact", "tp2-all_reduce"],
)
def test_triton_in_the_interpreter_meets_the_contract_on_random_cases(world, exact):
    """8 tiny cases per mode: residual bitwise (a two-term all-reduce rounds once), normed, quant."""
    why = triton_unavailable()
    if why:
        pytest.skip(f"triton backend not eligible on this checkout: {why}")
    env = {"TRITON_INTERPRET": "1", "ARNORM_TRITON_EXACT": "1" if exact else "0"}
    check(world, draw(cases(small=True), 8), "triton", env=env)
