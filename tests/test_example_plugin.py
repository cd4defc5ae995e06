"""The out-of-tree example distribution in backends/: discovered, ordered and selected like any plugin."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import arnorm
from arnorm._reference import add_rmsnorm


def _installed() -> bool:
    return any(ep.name == "example" for ep in importlib.metadata.entry_points(group="arnorm.backends"))


pytestmark = pytest.mark.skipif(not _installed(), reason="pip install -e backends/arnorm-example (CI does)")


def test_example_is_discovered_with_its_version():
    """The example plugin's entry point yields an available backend with its distribution's version."""
    info = {i.name: i for i in arnorm.backends()}["example"]
    assert (info.status, info.priority, info.version, info.plugin) == ("available", 10, "0.1.0", "example")


def test_priority_orders_example_between_triton_and_reference(clean_env):
    """Auto mode ranks the example (10) below triton (100) and above the reference (0)."""
    clean_env.setenv("ARNORM_DISABLE", "triton")
    with arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=64,
        dtype=torch.bfloat16,
        max_tokens=8,
        device="cpu",
        norm=arnorm.RMSNorm(1e-6),
    ) as op:
        order = [v.backend for v in op.explain().verdicts]
        assert op.backend == "example"
    assert order.index("triton") < order.index("example") < order.index("reference")


def test_selected_by_env_and_correct(clean_env):
    """ARNORM_BACKEND=example selects it; its output matches the reference contract."""
    clean_env.setenv("ARNORM_BACKEND", "example")
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    expect_h, expect_y = add_rmsnorm(x.clone(), r, w, 1e-6, 1.0)
    with arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=64,
        dtype=torch.bfloat16,
        norm=arnorm.RMSNorm(1e-6, 1.0),
        max_tokens=8,
        device="cpu",
    ) as op:
        assert op.backend == "example" and op.explain().source == "ARNORM_BACKEND"
        out = op(x, r, w)
    assert torch.equal(out.residual, expect_h) and torch.equal(out.normed, expect_y)


def test_strict_unsupported_format_names_the_reason(clean_env):
    """The example declares no nvfp4: asking for it by name fails with the capability reason."""
    with pytest.raises(
        arnorm.NoEligibleBackendError, match=r"quant: nvfp4 \(needs fp8_per_token, fp8_static or none\)"
    ):
        arnorm.AllReduceNorm(
            arnorm.LOCAL,
            hidden_size=64,
            dtype=torch.bfloat16,
            quant="nvfp4",
            backend="example",
            device="cpu",
            norm=arnorm.RMSNorm(1e-6),
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_not_inplace_leaves_hidden_states_at_tp2(dtype):
    """inplace=False at TP 2 leaves the caller's hidden_states as it was, fp32 included (.float() of
    an fp32 tensor is the tensor itself, which the example's in-place sum once overwrote)."""
    from arnorm.testing import run_ranks

    import ranks_fixtures as rf

    assert run_ranks(2, rf.not_inplace_leaves_hidden_states, "example", dtype) == [True, True]
