"""The core on a CUDA GPU: device defaults, validation across devices, graphs, compile, two ranks."""

from __future__ import annotations

import pytest
import torch

import arnorm
from arnorm._reference import add_rmsnorm
from arnorm.testing import run_ranks

import ranks_fixtures as rf

pytestmark = pytest.mark.gpu


def _inputs(t=8, h=1024, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    r = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    w = torch.randn(h, device="cuda", generator=g).to(dtype)
    return x, r, w


def test_default_device_is_the_current_gpu(clean_env):
    """Without device=, an op lives on the current CUDA device and reports its compute capability."""
    with arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=1024, dtype=torch.bfloat16, backend="reference", norm=arnorm.RMSNorm(1e-6)
    ) as op:
        assert op.problem.platform == "cuda" and op.problem.arch == torch.cuda.get_device_capability()


def test_cpu_tensor_to_gpu_op_is_rejected(clean_env):
    """A CPU tensor passed to a CUDA op is rejected naming the argument and both devices."""
    x, r, w = _inputs()
    with arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=1024, dtype=torch.bfloat16, backend="reference", norm=arnorm.RMSNorm(1e-6)
    ) as op:
        with pytest.raises(arnorm.InvalidInputError, match=r"residual: device cpu \(needs cuda:0"):
            op(x, r.cpu(), w)
        assert torch.equal(op(x.clone(), r, w).normed, add_rmsnorm(x, r, w, 1e-6, 0.0)[1])


def test_reference_call_replays_in_a_cuda_graph(clean_env):
    """A captured call replays with new inputs copied into the captured buffers."""
    x, r, w = _inputs()
    with arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=1024,
        dtype=torch.bfloat16,
        quant="fp8_per_token",
        inplace=False,
        backend="reference",
        norm=arnorm.RMSNorm(1e-6),
    ) as op:
        op(x, r, w)  # warm-up outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(x, r, w)
        x2, r2, _ = _inputs(dtype=torch.bfloat16)
        x.copy_(x2 * 3)
        r.copy_(r2)
        graph.replay()
        torch.cuda.synchronize()
        h, y = add_rmsnorm(x, r, w, 1e-6, 0.0)
        assert torch.equal(out.residual, h) and torch.equal(out.normed, y)


def test_compiled_model_with_inductor(clean_env):
    """torch.compile(fullgraph=True) with inductor calls the op through torch.ops.arnorm on the GPU."""
    x, r, w = _inputs()
    with arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=1024, dtype=torch.bfloat16, backend="reference", norm=arnorm.RMSNorm(1e-6)
    ) as op:

        def step(x, r, w):
            out = op(x, r, w)
            return out.normed.float().sum(), out.residual

        expect_h, expect_y = add_rmsnorm(x.clone(), r, w, 1e-6, 0.0)
        total, h = torch.compile(step, fullgraph=True)(x, r, w)
        assert torch.equal(h, expect_h) and torch.allclose(total, expect_y.float().sum())


def test_two_ranks_sharing_one_gpu_with_gloo(clean_env):
    """Two processes on one GPU with a gloo group: CUDA tensors reduce and match the contract."""
    results = run_ranks(2, rf.reference_matches_on_cuda, 5, 256)
    assert results == [(True, True)] * 2
