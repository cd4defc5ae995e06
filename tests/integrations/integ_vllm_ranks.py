"""What spawned ranks run for the vLLM entry-point tests (module-level functions, importable by name).

Each rank function asserts; a failure comes back as a RankError carrying the assertion.

Partials are drawn on a grid of multiples of 1/16 in [-2, 2], so any all-reduce order sums them
exactly: the "straightforward" unfused path (``dist.all_reduce`` + the Gemma norm in torch) is
then comparable bit for bit with the fused path at 4 ranks too, not only at 2.
"""

from __future__ import annotations

from typing import Any

import integ_fakes
import torch
import torch.distributed as dist

import arnorm
from arnorm.integrations import _vllm_groups as vllm_groups
from arnorm.integrations import vllm as av
from arnorm.quant import quantize

HIDDEN = 64
EPS = 1e-6
MAX_TOKENS = 32
#: Token counts: served by the fused test backend, only by the reference, above the budget.
SERVED, REFERENCE_ONLY, OVER_BUDGET = (1, 5, 16), 20, 40


def inputs(rank: int, world: int, tokens: int, dtype: torch.dtype, seed: int) -> tuple[Any, ...]:
    """This rank's partial, the shared residual and Gemma weight (every rank draws the same stream)."""
    g = torch.Generator().manual_seed(seed * 1000 + tokens)
    parts = [(torch.randint(-32, 33, (tokens, HIDDEN), generator=g) / 16).to(dtype) for _ in range(world)]
    residual = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(HIDDEN, generator=g) * 0.2).to(dtype)
    return parts[rank], residual, weight


def unfused(
    hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, unrounded: bool = False
) -> tuple[Any, Any]:
    """The seeds' unfused path written plainly: all_reduce, then GemmaRMSNorm(x, residual); with
    ``unrounded``, vLLM 0.33's norm (the statistic and the scaled value over the fp32 sum)."""
    x = hidden_states.clone()
    dist.all_reduce(x)
    hf = x.float() + residual.float()
    h = hf.to(x.dtype)
    if not unrounded:
        hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + weight.float())
    return y.to(x.dtype), h


def _same(a: torch.Tensor | None, b: torch.Tensor, what: str) -> None:
    assert a is not None, f"{what}: None"
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: differs bitwise"


def check_gemma_norm(rank: int, world: int, dtype: torch.dtype, seed: int) -> list[str]:
    """fused_allreduce_gemma_rms_norm: bitwise the unfused path at every token count; the fused path
    only where the fused backend serves, writing the residual into hidden_states."""
    paths = []
    for tokens in (*SERVED, REFERENCE_ONLY, OVER_BUDGET):
        x, residual, weight = inputs(rank, world, tokens, dtype, seed)
        norms = (integ_fakes.HFGemmaNorm(weight, EPS), integ_fakes.VllmGemmaNorm(weight, EPS),
                 integ_fakes.OldVllmGemmaNorm(weight, EPS))  # fmt: skip
        for norm in norms:
            # Each norm's own arithmetic, on both paths: vLLM 0.33's normalizes the unrounded sum.
            want_y, want_h = unfused(x, residual, weight, unrounded=getattr(norm, "unrounded", False))
            hs, res_before = x.clone(), residual.clone()
            normed, new_residual = av.fused_allreduce_gemma_rms_norm(hs, residual, norm)
            _same(normed, want_y, f"T={tokens} normed")
            _same(new_residual, want_h, f"T={tokens} residual")
            assert torch.equal(residual, res_before), "residual was modified"
            fused = tokens in SERVED
            assert (new_residual.data_ptr() == hs.data_ptr()) == fused, f"T={tokens}: in-place iff fused"
            if isinstance(norm, integ_fakes.VllmGemmaNorm):
                assert norm.calls == (0 if fused else 1), f"T={tokens}: vLLM norm ran {norm.calls}x"
        paths.append(f"{tokens}:{'fused' if fused else 'unfused'}")
    op = av.op_for(HIDDEN, dtype, EPS, norm=integ_fakes.VllmGemmaNorm(weight, EPS))
    assert op is not None and op.backend_for(5) == "fused" and op.backend_for(REFERENCE_ONLY) == "reference"
    assert "normalize_unrounded" in op.problem.norm_options or dtype == torch.float32
    return paths


def check_plain_norm(rank: int, world: int, dtype: torch.dtype, seed: int) -> None:
    """fused_allreduce_rms_norm (vLLM 0.33's plain helper): bitwise vLLM's CPU RMSNorm after the
    all-reduce at every token count, fused where the fused backend serves."""
    for tokens in (*SERVED, REFERENCE_ONLY, OVER_BUDGET):
        x, residual, weight = inputs(rank, world, tokens, dtype, seed)
        weight = (weight.float() + 1.0).to(dtype)
        norm = integ_fakes.VllmPlainNorm(weight, EPS)
        reduced = x.clone()
        dist.all_reduce(reduced)
        want_y, want_h = integ_fakes.VllmPlainNorm(weight, EPS).forward_native(reduced, residual)
        hs = x.clone()
        normed, new_residual = av.fused_allreduce_rms_norm(hs, residual, norm)
        _same(normed, want_y, f"plain T={tokens} normed")
        _same(new_residual, want_h, f"plain T={tokens} residual")
        assert norm.calls == (0 if tokens in SERVED else 1), f"plain T={tokens}: module ran {norm.calls}x"


def check_quant(rank: int, world: int, dtype: torch.dtype, seed: int) -> list[str]:
    """fused_allreduce_gemma_rms_norm_quant: every key at a served count matches the unfused path and
    arnorm.quant bit for bit; None (nothing touched) for reference-only and over-budget counts and for
    keys arnorm has no format for."""
    seen = []
    for fmt, key in integ_fakes.KEYS.items():
        for key_form in (key, fmt):
            x, residual, weight = inputs(rank, world, 8, dtype, seed)
            scale = {"fp8_static": torch.tensor([0.02]), "nvfp4": torch.tensor([448 * 6 / 3.0])}.get(fmt)
            # No norm module: vLLM 0.33's GemmaRMSNorm arithmetic (the unrounded sum).
            want_y, want_h = unfused(x, residual, weight, unrounded=True)
            hs = x.clone()
            got = av.fused_allreduce_gemma_rms_norm_quant(hs, residual, weight, EPS, scale, key_form)
            assert got is not None, f"{fmt}: None at a served token count"
            q, normed, new_residual = got
            _same(normed, want_y, f"{fmt} normed")
            _same(new_residual, want_h, f"{fmt} residual")
            # vLLM's fields: the caller's key, the input's dtype and shape; nvfp4 and a vLLM mxfp8
            # key: 128x4-swizzled scales (mxfp8 flat, as vLLM's mxfp8_e4m3_quantize); "mxfp8": row-major.
            assert type(q).__name__ == "QuantizedActivation" or type(q).__name__.endswith("StandIn")
            assert q.quant_key is key_form and q.orig_dtype == dtype and q.orig_shape == hs.shape
            layout = "swizzled_128x4" if fmt == "nvfp4" or (fmt == "mxfp8" and key_form is key) else None
            want_q = quantize(want_y, fmt, scale=scale, layout=layout)
            _same(q.data, want_q.data, f"{fmt} codes")
            want_scale = scale if fmt == "fp8_static" else want_q.scale
            if fmt == "mxfp8" and layout is not None:
                want_scale = want_scale.reshape(-1)
            _same(q.scale, want_scale, f"{fmt} scales")
        if fmt == "fp8_static":  # the caller's static scale itself, 0-d as vLLM keeps some
            x, residual, weight = inputs(rank, world, 8, dtype, seed)
            static = torch.tensor(0.02)
            got = av.fused_allreduce_gemma_rms_norm_quant(x, residual, weight, EPS, static, key)
            assert got is not None and got[0].scale is static, "the caller's static scale"
        for tokens in (REFERENCE_ONLY, OVER_BUDGET):
            x, residual, weight = inputs(rank, world, tokens, dtype, seed)
            hs = x.clone()
            scale = torch.tensor([0.02]) if fmt in ("fp8_static", "nvfp4") else None
            assert av.fused_allreduce_gemma_rms_norm_quant(hs, residual, weight, EPS, scale, key) is None, (
                f"{fmt} T={tokens}: not None"
            )
            assert torch.equal(hs, x), f"{fmt} T={tokens}: hidden_states touched by a None call"
        seen.append(fmt)
    x, residual, weight = inputs(rank, world, 8, dtype, seed)
    for name, key in integ_fakes.UNSUPPORTED.items():
        assert av.fused_allreduce_gemma_rms_norm_quant(x, residual, weight, EPS, None, key) is None, name
    return seen


def check_mxfp8(rank: int, world: int, dtype: torch.dtype, seed: int) -> None:
    """allreduce_gemma_rms_norm_mxfp8: (x_q, x_scale, normed | None, residual) wherever arnorm can
    compute it: fused where served, else the all-reduce then arnorm's norm + mxfp8 (not None);
    scales row-major ``[T, H // 32]`` when called as the seed calls it, 128x4-swizzled (flat) on request."""
    for tokens in (8, REFERENCE_ONLY, OVER_BUDGET):
        x, residual, weight = inputs(rank, world, tokens, dtype, seed)
        for norm in (integ_fakes.HFGemmaNorm(weight, EPS), integ_fakes.VllmGemmaNorm(weight, EPS)):
            want_y, want_h = unfused(x, residual, weight, unrounded=getattr(norm, "unrounded", False))
            for return_normed, layout in ((False, None), (False, "swizzled_128x4"), (True, "linear")):
                want_q = quantize(want_y, "mxfp8", layout=layout or "linear")
                if layout is None:  # the seed's call: no scale_layout
                    got = av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual, norm, return_normed)
                else:
                    got = av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual, norm, return_normed,
                                                            scale_layout=layout)  # fmt: skip
                assert got is not None, f"mxfp8 T={tokens}: None"
                x_q, x_scale, normed, new_residual = got
                _same(x_q, want_q.data, "mxfp8 codes")
                want_scale = want_q.scale.reshape(-1) if layout == "swizzled_128x4" else want_q.scale
                _same(x_scale, want_scale, f"mxfp8 {layout} scales")
                if layout is None:
                    assert tuple(x_scale.shape) == (tokens, HIDDEN // 32), f"seed call scales {x_scale.shape}"
                _same(new_residual, want_h, "mxfp8 residual")
                if return_normed:
                    _same(normed, want_y, "mxfp8 normed")
                else:
                    assert normed is None, "normed returned without return_normed"


def check_tp1(dtype: torch.dtype) -> None:
    """configure(group=arnorm.LOCAL): the plain add + Gemma norm, no all-reduce."""
    av.configure(group=arnorm.LOCAL, max_tokens=MAX_TOKENS)
    g = torch.Generator().manual_seed(7)
    x, residual = torch.randn(5, HIDDEN, generator=g).to(dtype), torch.randn(5, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(HIDDEN, generator=g) * 0.2).to(dtype)
    h = x + residual
    hf = h.float()
    want = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + weight.float())).to(dtype)
    normed, new_residual = av.fused_allreduce_gemma_rms_norm(
        x.clone(), residual, integ_fakes.HFGemmaNorm(weight, EPS)
    )
    _same(normed, want, "TP 1 normed")
    _same(new_residual, h, "TP 1 residual")
    op = av.op_for(HIDDEN, dtype, EPS)
    assert op is not None and op.problem.world_size == 1


def entry_points(rank: int, world: int, dtype_name: str) -> dict[str, Any]:
    """Every entry point over WORLD through configure(), then through a stand-in of vLLM's parallel state."""
    dtype = getattr(torch, dtype_name)
    integ_fakes.install_registry()
    av.configure(group=dist.group.WORLD, max_tokens=MAX_TOKENS)
    paths = check_gemma_norm(rank, world, dtype, seed=1)
    formats = check_quant(rank, world, dtype, seed=2)
    check_mxfp8(rank, world, dtype, seed=3)
    check_plain_norm(rank, world, dtype, seed=5)
    check_tp1(dtype)

    # vllm importable: its TP group and CPU group, its all_reduce for the unfused path.
    coordinator = integ_fakes.Coordinator(dist.group.WORLD, dist.group.WORLD, world)
    integ_fakes.install_vllm(coordinator)
    vllm_groups.VLLM_STATE.clear()
    av.configure()
    check_gemma_norm(rank, world, dtype, seed=4)
    op = av.op_for(HIDDEN, dtype, EPS)
    assert op is not None and ("normalize_unrounded" in op.problem.norm_options) == (dtype != torch.float32)
    assert op is not None and op._comm.group is dist.group.WORLD and op._comm.cpu_group is dist.group.WORLD
    # Three norms x (reference-only + over-budget counts) took the unfused path through vLLM's all_reduce.
    assert coordinator.all_reduces == 6, coordinator.all_reduces
    av.close()
    return {"paths": paths, "formats": formats}
