"""What each rank of the vLLM lane runs: vLLM's own parallel state over gloo, its norms, seed
functions, quant keys, QuantizedActivation and fp8 linear kernel, against arnorm's drop-ins.

Module-level functions (spawned ranks import them by name). Each returns a report dict of plain
values; the test module asserts on it and prints it into the lane's log.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

EPS = 1e-6
#: The drop-ins' token budget in the lane: counts above it take the unfused path.
MAX_TOKENS = 32
#: (hidden, tokens): below and above MAX_TOKENS, H 2048 and 4096 (the issue's measurement).
SHAPES = ((2048, 1), (2048, 7), (2048, 32), (2048, 48), (4096, 16), (4096, 64))
DTYPES = (torch.bfloat16, torch.float16)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from arnorm.testing._compare import ulps

    return ulps(a, b)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, int]:
    d = _ulps(a, b)
    return {"differ": int((d > 0).sum()), "total": d.numel(), "max_ulp": int(d.max())}


def _inputs(rank: int, world: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed * 7919 + tokens * 31 + hidden)
    parts = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(world)]
    residual = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.3).to(dtype)
    return parts[rank], residual, weight


@contextlib.contextmanager
def vllm_parallel_state(rank: int, world: int) -> Any:
    """vLLM's config context and its parallel state at TP ``world`` over gloo (the process group
    run_ranks made is WORLD; vLLM builds its groups on it)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world, rank, "env://", rank, backend="gloo")
        ps.initialize_model_parallel(world, backend="gloo")
        try:
            yield ps
        finally:
            ps.destroy_model_parallel()


def _norms(
    hidden: int, dtype: torch.dtype, weight: torch.Tensor, weight_dtype: torch.dtype | None = None
) -> tuple[Any, Any]:
    """vLLM's GemmaRMSNorm and RMSNorm holding ``weight`` (the plain one ``1 + weight``), their
    parameters in ``weight_dtype`` (default: the model dtype, as vLLM's loader makes them)."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    previous = torch.get_default_dtype()
    torch.set_default_dtype(weight_dtype or dtype)
    try:
        gemma, plain = GemmaRMSNorm(hidden, EPS), RMSNorm(hidden, EPS)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        gemma.weight.copy_(weight)
        plain.weight.copy_((weight.float() + 1).to(dtype))  # values the model dtype holds
    return gemma, plain


def check_norms(rank: int, world: int) -> dict[str, Any]:
    """Both drop-ins against vLLM 0.33's own helpers (their unfused path on CPU), with arnorm's
    triton kernel serving (interpreted): residual bitwise, normed up to the order of the squares."""
    from vllm.model_executor.layers.fused_allreduce_gemma_rms_norm import (
        fused_allreduce_gemma_rms_norm as vllm_gemma,
    )
    from vllm.models.common.ops.fused_allreduce_rms_norm import fused_allreduce_rms_norm as vllm_plain

    from arnorm._reference import add_rmsnorm, rank_order_sum
    from arnorm.integrations import vllm as av

    rows = []
    # fp16 activations also with fp32 norm weights (a module may keep its norms in fp32; issue 44).
    cases = [(dtype, None) for dtype in DTYPES] + [(torch.float16, torch.float32)]
    for dtype, weight_dtype in cases:
        for hidden, tokens in SHAPES:
            x, residual, weight = _inputs(rank, world, tokens, hidden, dtype, 1)
            gemma, plain = _norms(hidden, dtype, weight, weight_dtype)
            for kind, norm, theirs, ours in (
                ("gemma", gemma, vllm_gemma, av.fused_allreduce_gemma_rms_norm),
                ("plain", plain, vllm_plain, av.fused_allreduce_rms_norm),
            ):
                want_y, want_h = theirs(x.clone(), residual.clone(), norm)
                op = av.op_for(hidden, dtype, EPS, norm=norm, device="cpu")
                backend = op.backend_for(tokens) if tokens <= MAX_TOKENS else "unfused (over budget)"
                av.served_calls(reset=True)
                got_y, got_h = ours(x.clone(), residual.clone(), norm)
                (served,) = av.served_calls(reset=True).values()  # what served this one call
                row = {
                    "kind": kind, "dtype": str(dtype).removeprefix("torch."), "hidden": hidden,
                    "weights": str(norm.weight.dtype).removeprefix("torch."),
                    "tokens": tokens, "backend": backend, "residual_bitwise": _bitwise(got_h, want_h),
                    "normed": _diff(got_y, want_y), "problem": op.problem.short(), "served": served,
                }  # fmt: skip
                if kind == "gemma":
                    # What arnorm computed before issue 35 (the statistic over the rounded sum).
                    parts = [_inputs(r, world, tokens, hidden, dtype, 1)[0] for r in range(world)]
                    _, old = add_rmsnorm(rank_order_sum(parts), residual, weight, EPS, 1.0)
                    row["rounded_sum_arithmetic"] = _diff(old, want_y)
                rows.append(row)
    av.close()
    return {"rows": rows}


def check_state(rank: int, world: int) -> dict[str, Any]:
    """arnorm's entry points take vLLM's TP group (its device and CPU groups) by themselves."""
    from vllm.distributed import parallel_state as ps

    from arnorm.integrations import vllm as av

    op = av.op_for(256, torch.bfloat16, EPS, device="cpu")
    tp = ps.get_tp_group()
    if world == 1:
        same = op.problem.world_size == 1
    else:
        same = op._comm.group is tp.device_group and op._comm.cpu_group is tp.cpu_group
    return {"tp_world_size": tp.world_size, "uses_vllm_groups": bool(same)}


def check_keys() -> dict[str, Any]:
    """vLLM 0.33's real QuantKeys map to arnorm's formats by their fields; the others to None."""
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu

    from arnorm.integrations._vllm_keys import format_of_key

    names = (
        "kFp8StaticTensorSym", "kFp8DynamicTokenSym", "kNvfp4Dynamic", "kMxfp8Dynamic",
        "kFp8DynamicTensorSym", "kFp8StaticTokenSym", "kFp8Dynamic128Sym", "kNvfp4DynamicToken",
        "kNvfp4Static", "kMxfp8Static",
    )  # fmt: skip
    return {name: format_of_key(getattr(qu, name)) for name in names}


def _fp8_linear(
    hidden: int, out_features: int, dtype: torch.dtype, input_scale: torch.Tensor
) -> tuple[Any, Any]:
    """vLLM's real PerTensorTorchFP8ScaledMMLinearKernel and a layer holding its parameters."""
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import PerTensorTorchFP8ScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8StaticTensorSym

    config = FP8ScaledMMLinearLayerConfig(
        weight_quant_key=kFp8StaticTensorSym,
        activation_quant_key=kFp8StaticTensorSym,
        weight_shape=(out_features, hidden),
        input_dtype=dtype,
        out_dtype=dtype,
    )
    kernel = PerTensorTorchFP8ScaledMMLinearKernel(
        config, ("weight", "weight_scale", "input_scale", "input_scale_ub")
    )
    g = torch.Generator().manual_seed(5)
    layer = torch.nn.Module()
    w = (torch.randn(out_features, hidden, generator=g) * 0.5).to(torch.float8_e4m3fn)
    layer.weight = torch.nn.Parameter(w.t(), requires_grad=False)  # [K, N], column-major, as vLLM keeps it
    layer.weight_scale = torch.nn.Parameter(torch.tensor(0.01), requires_grad=False)
    layer.input_scale = torch.nn.Parameter(input_scale, requires_grad=False)
    layer.input_scale_ub = None
    return kernel, layer


def check_quant(rank: int, world: int) -> dict[str, Any]:
    """The quant entry point returns vLLM's QuantizedActivation; vLLM's fp8 kernel takes it, and its
    GEMM output is bitwise vLLM's own static quantization of arnorm's normed output through the same
    kernel. arnorm's own QuantizedActivation (what the entry point returned before) is refused."""
    from vllm._custom_ops import create_fp4_scale_tensor
    from vllm.model_executor.layers.fused_allreduce_gemma_rms_norm import (
        fused_allreduce_gemma_rms_norm as vllm_gemma,
    )
    from vllm.model_executor.layers.fusion.quant_activation import QuantizedActivation
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch

    import arnorm
    from arnorm.integrations import vllm as av

    out: dict[str, Any] = {}
    hidden, tokens, dtype = 2048, 8, torch.bfloat16
    x, residual, weight = _inputs(rank, world, tokens, hidden, dtype, 2)
    gemma, _ = _norms(hidden, dtype, weight)
    input_scale = torch.tensor(0.02, dtype=torch.float32)
    kernel, layer = _fp8_linear(hidden, 256, dtype, input_scale)
    got = av.fused_allreduce_gemma_rms_norm_quant(
        x.clone(),
        residual.clone(),
        gemma.weight.data,
        EPS,
        layer.input_scale,
        qu.kFp8StaticTensorSym,
        norm=gemma,
    )
    assert got is not None, "fp8_static: None with the triton backend serving"
    q, normed, _ = got
    out["fp8_type"] = type(q).__module__ + "." + type(q).__qualname__
    out["fp8_fields"] = {
        "quant_key_is_callers": q.quant_key is qu.kFp8StaticTensorSym,
        "scale_is_callers": q.scale is layer.input_scale,
        "orig_dtype": str(q.orig_dtype), "orig_shape": list(q.orig_shape),
    }  # fmt: skip
    fused_gemm = kernel.apply_weights(layer, q)
    own_gemm = kernel.apply_weights(layer, normed)  # vLLM quantizes arnorm's normed output itself
    out["gemm_bitwise_vs_vllm_quant_of_arnorm_normed"] = _bitwise(fused_gemm, own_gemm)
    want_y, _ = vllm_gemma(x.clone(), residual.clone(), gemma)
    chain = kernel.apply_weights(layer, want_y)  # vLLM's whole unfused chain
    out["gemm_vs_vllm_unfused_chain"] = _diff(fused_gemm, chain)
    out["normed_vs_vllm_unfused"] = _diff(normed, want_y)
    stale = arnorm.QuantizedActivation(q.data, q.scale, "fp8_static", None, None)  # type: ignore[arg-type]
    try:
        kernel.apply_weights(layer, stale)
        out["arnorm_type_refused"] = False
    except AssertionError as exc:
        out["arnorm_type_refused"] = f"AssertionError: {exc}".strip()

    got4 = av.fused_allreduce_gemma_rms_norm_quant(
        x.clone(), residual.clone(), gemma.weight.data, EPS, torch.tensor([448 * 6 / 4.0]), qu.kNvfp4Dynamic,
        norm=gemma,
    )  # fmt: skip
    assert got4 is not None
    q4 = got4[0]
    want4 = create_fp4_scale_tensor(tokens, hidden, torch.device("cpu"), True).view(torch.float8_e4m3fn)
    out["nvfp4"] = {
        "type_is_vllms": isinstance(q4, QuantizedActivation),
        "quant_key_is_callers": q4.quant_key is qu.kNvfp4Dynamic,
        "scale_shape_dtype_as_scaled_fp4_quant": (tuple(q4.scale.shape), q4.scale.dtype)
        == (tuple(want4.shape), want4.dtype),
        "data": [list(q4.data.shape), str(q4.data.dtype)],
    }

    got8 = av.fused_allreduce_gemma_rms_norm_quant(
        x.clone(), residual.clone(), gemma.weight.data, EPS, None, qu.kMxfp8Dynamic, norm=gemma
    )
    assert got8 is not None
    q8 = got8[0]
    _, vllm_sf = _mxfp8_e4m3_quantize_torch(got8[1], is_sf_swizzled_layout=True)
    out["mxfp8_quant_entry"] = {
        "type_is_vllms": isinstance(q8, QuantizedActivation),
        "scale_shape_dtype_as_vllm_swizzled": (tuple(q8.scale.shape), q8.scale.dtype)
        == (tuple(vllm_sf.shape), vllm_sf.dtype),
        "scale_bytes_equal_vllm_torch_mxfp8": _bitwise(q8.scale, vllm_sf),
    }
    av.close()
    return out


def check_mxfp8(rank: int, world: int) -> dict[str, Any]:
    """allreduce_gemma_rms_norm_mxfp8 returns a result below and above the budget (fused, or the
    all-reduce then arnorm's norm + mxfp8). Called as the seed calls it, the scales are row-major E8M0
    ``[T, H // 32]``; ``scale_layout="swizzled_128x4"`` gives what vLLM's mxfp8 linears read."""
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch

    from arnorm.integrations import vllm as av
    from arnorm.quant import quantize

    rows = []
    hidden, dtype = 2048, torch.bfloat16
    for tokens in (4, 48):
        x, residual, weight = _inputs(rank, world, tokens, hidden, dtype, 3)
        gemma, _ = _norms(hidden, dtype, weight)
        got = av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual.clone(), gemma, True)
        seed = av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual.clone(), gemma)
        swz = av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual.clone(), gemma, True,
                                                scale_layout="swizzled_128x4")  # fmt: skip
        row: dict[str, Any] = {"tokens": tokens, "returned": None not in (got, seed, swz)}
        if got is not None and seed is not None and swz is not None:
            x_q, x_scale, normed, _ = got
            want = quantize(normed, "mxfp8", layout="linear")
            _, vllm_sf = _mxfp8_e4m3_quantize_torch(normed, is_sf_swizzled_layout=True)
            row.update(
                codes_are_arnorm_quant=_bitwise(x_q, want.data),
                seed_call_scale_shape=list(seed[1].shape),
                seed_call_scale_dtype=str(seed[1].dtype),
                seed_call_scales_row_major=_bitwise(seed[1], want.scale) and _bitwise(x_scale, want.scale),
                seed_call_normed_is_none=seed[2] is None,
                swizzled_scale_shape_as_vllm=tuple(swz[1].shape) == tuple(vllm_sf.shape),
                swizzled_scale_bytes_equal_vllm_torch_mxfp8=_bitwise(swz[1], vllm_sf),
            )
        rows.append(row)
    av.close()
    return {"hidden": hidden, "rows": rows}


def lane(rank: int, world: int) -> dict[str, Any]:
    """Everything, on one rank of vLLM's TP ``world`` group (arnorm's triton backend, interpreted)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from arnorm.integrations import vllm as av

    with vllm_parallel_state(rank, world):
        av.configure(max_tokens=MAX_TOKENS, backend=["triton", "reference"])
        report = {
            "state": check_state(rank, world),
            "keys": check_keys(),
            "norms": check_norms(rank, world),
            "quant": check_quant(rank, world),
            "mxfp8": check_mxfp8(rank, world),
        }
        av.configure()
    return report
