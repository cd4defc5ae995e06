"""Stand-ins for the compile pass tests where vLLM is not installed: vLLM's seam ops (``vllm.all_reduce``,
``vllm_ir.rms_norm``, ``vllm_ir.fused_add_rms_norm``, ``_C.static_scaled_fp8_quant``) with vLLM 0.33's
schemas and native arithmetic, its parallel state's group registry, and the compile modules the pass
and its installer import (``InductorPass``, ``CompilationConfig``, ``PassConfig``, ``EngineArgs``,
``VllmBackend.configure_post_pass``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import types
import weakref
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

GROUP = "tp:0"
_libs: list[Any] = []


def _define_ops() -> None:
    if _libs:
        return
    vllm = torch.library.Library("vllm", "FRAGMENT")
    vllm.define("all_reduce(Tensor tensor, str group_name) -> Tensor")
    vllm.impl("all_reduce", lambda tensor, group_name: _coordinators[group_name].all_reduce(tensor),
              "CompositeExplicitAutograd")  # fmt: skip
    vllm._register_fake("all_reduce", lambda tensor, group_name: torch.empty_like(tensor))
    ir = torch.library.Library("vllm_ir", "FRAGMENT")
    ir.define("rms_norm(Tensor x, Tensor? weight, float epsilon, SymInt? variance_size=None) -> Tensor")
    ir.define("fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, float epsilon, "
              "SymInt? variance_size=None) -> (Tensor, Tensor)")  # fmt: skip
    ir.impl("rms_norm", rms_norm, "CompositeExplicitAutograd")
    ir.impl("fused_add_rms_norm", fused_add_rms_norm, "CompositeExplicitAutograd")
    ir._register_fake("rms_norm", lambda x, w, eps, vs=None: torch.empty_like(x))
    ir._register_fake(
        "fused_add_rms_norm", lambda x, r, w, eps, vs=None: (x.new_empty(x.shape), x.new_empty(x.shape))
    )
    c = torch.library.Library("_C", "FRAGMENT")
    c.define("static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
             "int[]? group_shape=None) -> ()")  # fmt: skip
    c.impl("static_scaled_fp8_quant", static_scaled_fp8_quant, "CompositeExplicitAutograd")
    c._register_fake("static_scaled_fp8_quant", lambda result, input, scale, group_shape=None: None)
    c.define("per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, "
             "float eps, float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, "
             "bool dummy_is_tma_aligned) -> ()")  # fmt: skip
    c.impl("per_token_group_fp8_quant", per_token_group_fp8_quant, "CompositeExplicitAutograd")
    c._register_fake("per_token_group_fp8_quant", lambda *args, **kwargs: None)
    c.define("per_token_group_fp8_quant_packed(Tensor input, Tensor! output_q, Tensor! output_s_packed, "
             "int group_size, float eps, float fp8_min, float fp8_max) -> ()")  # fmt: skip
    c._register_fake("per_token_group_fp8_quant_packed", lambda *args, **kwargs: None)
    vllm.define("flashinfer_mxfp4_quantize(Tensor a, str backend) -> (Tensor, Tensor)")
    vllm._register_fake("flashinfer_mxfp4_quantize", _mxfp4_fake)
    _libs.extend([vllm, ir, c])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: Any = None) -> Any:
    """vLLM 0.33's ``vllm/ir/ops/layernorm.py`` ``rms_norm`` (native)."""
    orig = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig)


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: Any = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """vLLM 0.33's ``fused_add_rms_norm`` (native): normalizes the unrounded fp32 sum."""
    orig = x.dtype
    x = x.to(torch.float32) + x_residual.to(torch.float32)
    res = x.to(orig)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig), res


def static_scaled_fp8_quant(result: torch.Tensor, input: torch.Tensor, scale: torch.Tensor,
                            group_shape: Any = None) -> None:  # fmt: skip
    finfo = torch.finfo(torch.float8_e4m3fn)
    q = (input.to(torch.float32) * scale.to(torch.float32).reciprocal()).clamp(finfo.min, finfo.max)
    result.copy_(q.to(torch.float8_e4m3fn))


def _mxfp4_fake(a: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = (a.shape[0] + 127) // 128 * 128
    return a.new_empty(a.shape[0], a.shape[1] // 2, dtype=torch.uint8), a.new_empty(
        rows, a.shape[1] // 32, dtype=torch.uint8
    )


def per_token_group_fp8_quant(
    input: torch.Tensor, output_q: torch.Tensor, output_s: torch.Tensor, group_size: int, eps: float,
    fp8_min: float, fp8_max: float, scale_ue8m0: bool, dummy_is_scale_transposed: bool,
    dummy_is_tma_aligned: bool,
) -> None:  # fmt: skip
    """vLLM 0.33's ``_per_token_group_quant_fp8`` (its Triton fallback), step for step: the group's
    maximum floored at ``eps``, times ``1 / fp8_max``, rounded up to a power of two for UE8M0, a true
    quotient clamped to the fp8 range. The scales go wherever ``output_s``'s strides put them."""
    t, h = input.shape
    y = input.to(torch.float32).reshape(t, h // group_size, group_size)
    scale = y.abs().amax(dim=-1).clamp_min(eps) * (1.0 / fp8_max)
    if scale_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (y / scale.unsqueeze(-1)).clamp(fp8_min, fp8_max).to(output_q.dtype)
    output_q.copy_(q.reshape(t, h))
    output_s.copy_(scale)


class Coordinator:
    """vLLM's GroupCoordinator as the op reads it: TP 1, so its all-reduce is the identity."""

    world_size = 1
    device_group = cpu_group = None

    def __init__(self, name: str) -> None:
        self.unique_name = name
        self.reductions = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reductions += 1
        return x.clone()


_coordinators: dict[str, Coordinator] = {}


class InductorPass(CustomGraphPass):  # type: ignore[misc]
    """vLLM 0.33's ``vllm.compilation.passes.inductor_pass.InductorPass``, as arnorm's pass uses it."""

    def uuid(self) -> Any:
        return "base"

    @staticmethod
    def hash_dict(d: dict[Any, Any]) -> str:
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass
class PassConfig:
    fuse_allreduce_rms: bool | None = None


@dataclasses.dataclass
class CompilationConfig:
    inductor_compile_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    pass_config: PassConfig = dataclasses.field(default_factory=PassConfig)


@dataclasses.dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 16


@dataclasses.dataclass
class VllmConfig:
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)


class EngineArgs:
    def __init__(self, compilation_config: Any = None) -> None:
        self.compilation_config = CompilationConfig() if compilation_config is None else compilation_config

    def create_engine_config(self) -> VllmConfig:
        cc = self.compilation_config
        if isinstance(cc, dict):
            cc = CompilationConfig(pass_config=PassConfig(**cc.get("pass_config", {})))
        if cc.pass_config.fuse_allreduce_rms is None:  # vLLM's -O2 default on a FlashInfer GPU
            cc.pass_config.fuse_allreduce_rms = True
        return VllmConfig(compilation_config=cc)


class VllmBackend:
    def configure_post_pass(self) -> None:
        # Config should automatically wrap all inductor passes
        key = "post_grad_custom_post_pass"
        assert isinstance(self.inductor_config[key], InductorPass)  # type: ignore[attr-defined]


def install(monkeypatch: Any, batch_invariant: bool = False) -> dict[str, types.ModuleType]:
    """vLLM's modules the pass imports, as stand-ins in ``sys.modules`` (undone by ``monkeypatch``)."""
    _define_ops()
    # The plugin wraps EngineArgs.create_engine_config: undone with the rest.
    monkeypatch.setattr(EngineArgs, "create_engine_config", EngineArgs.__dict__["create_engine_config"])
    _coordinators.clear()
    _coordinators[GROUP] = Coordinator(GROUP)
    modules = {}
    for name, attrs in {
        "vllm": {},
        "vllm.envs": {"VLLM_BATCH_INVARIANT": batch_invariant},
        "vllm.compilation": {},
        "vllm.compilation.backends": {"VllmBackend": VllmBackend},
        "vllm.compilation.passes": {},
        "vllm.compilation.passes.inductor_pass": {"InductorPass": InductorPass},
        "vllm.config": {"CompilationConfig": CompilationConfig, "PassConfig": PassConfig,
                        "VllmConfig": VllmConfig},
        "vllm.engine": {},
        "vllm.engine.arg_utils": {"EngineArgs": EngineArgs},
        "vllm.distributed": {},
        "vllm.distributed.parallel_state": {"_groups": {GROUP: weakref.ref(_coordinators[GROUP])}},
    }.items():  # fmt: skip
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
        modules[name] = module
    modules["vllm.distributed"].parallel_state = modules["vllm.distributed.parallel_state"]  # type: ignore[attr-defined]
    monkeypatch.delitem(sys.modules, "arnorm.integrations._vllm_pass", raising=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if batch_invariant else "0")
    return modules


def coordinator() -> Coordinator:
    return _coordinators[GROUP]
