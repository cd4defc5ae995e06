"""Stand-ins for the integration tests: a fused test backend, vLLM's quant keys, norms and parallel state."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from arnorm.plugin import (
    QUANT_FORMATS,
    BackendSpec,
    Capabilities,
    Output,
    add_rmsnorm,
    quantize_output,
    rank_order_sum,
)

#: The most tokens the fused test backend serves; above it only the reference would.
FUSED_LIMIT = 16
ALL_QUANT = frozenset({"none", *QUANT_FORMATS})


class FusedTestBackend:
    """A 'fused' backend for the tests: the reference's arithmetic (all-gather, rank-order fp32 sum),
    serving at most FUSED_LIMIT tokens, so both sides of the integrations' None contract show."""

    name: ClassVar[str] = "fused"

    def __init__(self, problem: Any, comm: Any) -> None:
        self.problem, self.comm = problem, comm

    @classmethod
    def probe(cls, problem: Any) -> tuple[str, ...]:
        return ()

    @classmethod
    def create(cls, problem: Any, comm: Any, settings: Any) -> FusedTestBackend:
        return cls(problem, comm)

    def check_tokens(self, num_tokens: int) -> tuple[str, ...]:
        if num_tokens > FUSED_LIMIT:
            return (f"tokens: {num_tokens} (needs <= {FUSED_LIMIT}, the test workspace)",)
        return ()

    def __call__(self, hidden_states: Any, residual: Any, weight: Any, scale: Any) -> Output:
        p = self.problem
        s = rank_order_sum(self.comm.all_gather(hidden_states))
        h, y = add_rmsnorm(s, residual, weight, p.eps, p.weight_offset, **dict.fromkeys(p.norm_options, True))
        q = quantize_output(y, p.quant, scale, p.scale_layout)
        if p.inplace:
            h = hidden_states.copy_(h)
        return Output(y if p.normed_output else None, h, q)

    def close(self) -> None:
        return None


def install_registry() -> None:
    """Make the reference and the fused test backend the only registered backends of this process."""
    from arnorm.registry._discovery import Registry, reset_registry

    caps = Capabilities(
        platforms=frozenset({"cpu", "cuda"}),
        quant=ALL_QUANT,
        norm_options=frozenset({"round_before_weight", "normalize_unrounded"}),
    )
    reg = Registry()
    reg.add(
        BackendSpec(
            name="reference",
            priority=0,
            capabilities=caps,
            loader="arnorm._reference:ReferenceBackend",
        ),
        plugin="arnorm",
    )
    reg.add(
        BackendSpec(name="fused", priority=50, capabilities=caps, loader="integ_fakes:FusedTestBackend"),
        plugin="tests",
    )
    reset_registry(reg)


# -- vLLM's quantization keys, with the fields of vllm/.../quant_utils.py ------------------------------


@dataclass(frozen=True)
class ScaleDesc:
    dtype: torch.dtype
    static: bool
    group_shape: tuple[int, int]


@dataclass(frozen=True)
class QuantKey:
    dtype: torch.dtype
    scale: ScaleDesc
    scale2: ScaleDesc | None = None
    symmetric: bool = True


_STATIC_TENSOR = ScaleDesc(torch.float32, True, (-1, -1))
KEYS = {
    "fp8_static": QuantKey(torch.float8_e4m3fn, _STATIC_TENSOR),
    "fp8_per_token": QuantKey(torch.float8_e4m3fn, ScaleDesc(torch.float32, False, (1, -1))),
    "nvfp4": QuantKey(torch.uint8, ScaleDesc(torch.float8_e4m3fn, False, (1, 16)), scale2=_STATIC_TENSOR),
    "mxfp8": QuantKey(torch.float8_e4m3fn, ScaleDesc(torch.uint8, False, (1, 32))),
}
#: vLLM's keys of the per-token-group and MX formats (kFp8Dynamic128Sym, kFp8Dynamic64Sym,
#: kMxfp4Dynamic), by arnorm format: hidden sizes of a multiple of 128 (KEYS' tests use 64).
GROUP_KEYS = {
    "fp8_per_group": QuantKey(torch.float8_e4m3fn, ScaleDesc(torch.float32, False, (1, 128))),
    "fp8_per_group_64": QuantKey(torch.float8_e4m3fn, ScaleDesc(torch.float32, False, (1, 64))),
    "mxfp4": QuantKey(torch.uint8, ScaleDesc(torch.uint8, False, (1, 32))),
}
#: Keys arnorm has no format for.
UNSUPPORTED = {
    "fp8 dynamic per-tensor": QuantKey(torch.float8_e4m3fn, ScaleDesc(torch.float32, False, (-1, -1))),
    "e4m3fnuz static": QuantKey(torch.float8_e4m3fnuz, _STATIC_TENSOR),
    "asymmetric fp8": QuantKey(torch.float8_e4m3fn, _STATIC_TENSOR, symmetric=False),
    "int8 name": "int8",
    "none": None,
}


class HFGemmaNorm(torch.nn.Module):
    """A Hugging Face style Gemma norm: ``weight`` and ``eps``, one argument."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps


class _VllmNorm(torch.nn.Module):
    """A vLLM style norm: ``weight``, ``variance_epsilon`` and ``forward_native(x, residual)``."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)


class VllmGemmaNorm(_VllmNorm):
    """A vLLM style Gemma norm; counts calls.

    By default vLLM 0.33's arithmetic (``ir.ops.fused_add_rms_norm``): the add in fp32, the rounded
    sum returned as the residual, the statistic and the scaled value over the unrounded fp32 sum."""

    #: False: the add rounded to the dtype first and normalized, as vLLM <= 0.17's GemmaRMSNorm.
    unrounded = True
    #: True: an fp16 residual add in fp32, the fp32 sum returned, as older vLLM's GemmaRMSNorm did.
    fp32_residual_in_fp16 = False

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        self.calls += 1
        if residual is None:
            h = hf = x.float()
        else:
            hf = x.float() + residual.float()
            h = hf if self.fp32_residual_in_fp16 and x.dtype == torch.float16 else hf.to(x.dtype)
            if not self.unrounded:
                hf = h.float()
        y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        y = (y * (1.0 + self.weight.float())).to(x.dtype)
        return y if residual is None else (y, h)


class OldVllmGemmaNorm(VllmGemmaNorm):
    """vLLM <= 0.17's GemmaRMSNorm: the sum rounded to the dtype, then normalized."""

    unrounded = False


class VllmPlainNorm(_VllmNorm):
    """vLLM 0.33's plain ``RMSNorm`` on CPU: the same sum, then ``D(D(x * rsqrt) * weight)``."""

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        self.calls += 1
        hf = x.float() + residual.float()
        h = hf.to(x.dtype)
        n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (n.to(x.dtype) * self.weight).to(x.dtype), h


VllmPlainNorm.__name__ = VllmPlainNorm.__qualname__ = "RMSNorm"


class Coordinator:
    """vLLM's GroupCoordinator as the integration reads it; counts all-reduces."""

    def __init__(self, device_group: Any, cpu_group: Any, world_size: int) -> None:
        self.device_group, self.cpu_group, self.world_size = device_group, cpu_group, world_size
        self.all_reduces = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.all_reduces += 1
        out = x.clone()
        dist.all_reduce(out, group=self.device_group)
        return out


def install_vllm(coordinator: Any) -> types.ModuleType:
    """Put a minimal ``vllm.distributed.parallel_state`` in ``sys.modules``; ``get_tp_group`` returns
    ``coordinator``, or raises AssertionError as vLLM does before its groups exist when it is None."""

    def get_tp_group() -> Any:
        assert coordinator is not None, "tensor model parallel group is not initialized"
        return coordinator

    vllm = types.ModuleType("vllm")
    distributed = types.ModuleType("vllm.distributed")
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.get_tp_group = get_tp_group  # type: ignore[attr-defined]
    vllm.distributed = distributed  # type: ignore[attr-defined]
    distributed.parallel_state = state  # type: ignore[attr-defined]
    sys.modules.update(
        {"vllm": vllm, "vllm.distributed": distributed, "vllm.distributed.parallel_state": state}
    )
    return state
