"""``op(..., out=...)`` on a CUDA GPU through the public op: the direct launch writes caller buffers."""

from __future__ import annotations

import pytest
import torch
from triton_cases import VARIANTS, variant_id

import arnorm

pytestmark = pytest.mark.gpu

H = 4096


def _op(quant, layout, normed=True, inplace=True, max_tokens=256):
    return arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), quant=quant,
        scale_layout=layout, max_tokens=max_tokens, backend="triton", normed_output=normed,
        inplace=inplace, device="cuda",
    )  # fmt: skip


def _inputs(t, quant, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((t, H), generator=g, device="cuda").bfloat16()
    r = torch.randn((t, H), generator=g, device="cuda").bfloat16()
    w = (torch.randn((H,), generator=g, device="cuda") * 0.1 + 1).bfloat16()
    s = torch.tensor([0.05], device="cuda") if quant in ("fp8_static", "nvfp4") else None
    return x, r, w, s


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same(a, b):
    pairs = [(a.residual, b.residual)] + ([(a.normed, b.normed)] if a.normed is not None else [])
    if a.quant is not None:
        pairs += [(a.quant.data, b.quant.data), (a.quant.scale, b.quant.scale)]
    return all(torch.equal(_bits(u), _bits(v)) for u, v in pairs)


@pytest.mark.parametrize("t", [1, 7, 130])
@pytest.mark.parametrize(
    ("variant", "normed", "inplace"),
    # an op with neither a normed nor a quantized output is refused at construction
    [(v, n, i) for v in VARIANTS for n, i in ((True, True), (False, True), (True, False)) if v[0] or n],
    ids=lambda p: variant_id(p) if isinstance(p, tuple) else str(p),
)
def test_out_on_gpu_is_bitwise_the_allocating_call(variant, t, normed, inplace):
    """Every format at T 1 / 7 / 130: out= gives the allocating call's bits, in out's tensors."""
    quant, layout = variant
    with _op(quant, layout, normed, inplace) as op:
        assert op._plan.table[1].launcher.fast  # the direct launch is what writes out
        x, r, w, s = _inputs(t, quant)
        expect = op(x.clone(), r, w, s)
        out = op.empty_output(t, s)
        for _ in range(2):
            got = op(x.clone(), r, w, s, out=out)
            assert _same(expect, got)
            assert got.normed is out.normed
            if quant is not None:
                assert got.quant.data is out.quant.data


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_out_under_cuda_graph_replay(variant):
    """A graph captured with out= replays into the same buffers, matching eager calls on new inputs."""
    quant, layout = variant
    t = 16
    with _op(quant, layout) as op:
        x, r, w, s = _inputs(t, quant)
        out = op.empty_output(t, s)
        static_x = x.clone()
        op(static_x.clone(), r, w, s, out=out)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = op(static_x, r, w, s, out=out)
        for seed in range(1, 6):
            new_x, new_r, _, _ = _inputs(t, quant, seed)
            static_x.copy_(new_x)
            r.copy_(new_r)
            graph.replay()
            torch.cuda.synchronize()
            expect = op(new_x.clone(), new_r, w, s)
            assert _same(expect, got)
