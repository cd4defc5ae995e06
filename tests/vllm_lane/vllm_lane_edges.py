"""What each rank of ``test_vllm_dropin_edges.py`` runs: arnorm's vLLM drop-ins against vLLM 0.33's
own helpers and norms where a new user pushes them (issue items: a probe nothing matches, reloaded
fp32 weights, subclasses, ``residual=None``, mixed dtypes, ``ARNORM_VLLM=0`` on one rank).

Module-level functions (spawned ranks import them by name); each returns plain data.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
from vllm_lane_ranks import EPS, _bitwise, vllm_parallel_state

H = 256


def _vllm_helpers() -> tuple[Any, Any]:
    from vllm.model_executor.layers.fused_allreduce_gemma_rms_norm import fused_allreduce_gemma_rms_norm
    from vllm.models.common.ops.fused_allreduce_rms_norm import fused_allreduce_rms_norm

    return fused_allreduce_gemma_rms_norm, fused_allreduce_rms_norm


def _rows(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, H, generator=g) * 2).to(dtype), torch.randn(tokens, H, generator=g).to(dtype)


def _gemma(weight_dtype: torch.dtype = torch.bfloat16, seed: int = 3) -> Any:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    norm = GemmaRMSNorm(H, EPS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.data = (torch.randn(H, generator=g) * 0.3).to(torch.bfloat16).to(weight_dtype)
    return norm


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and _bitwise(got, want)
    return (
        isinstance(got, tuple)
        and len(got) == len(want)
        and all(isinstance(a, torch.Tensor) and _bitwise(a, b) for a, b in zip(got, want, strict=True))
    )


def _call(fn: Any, *args: Any) -> tuple[Any, list[str]]:
    from arnorm.integrations import vllm as av

    av.served_calls(reset=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in said if "arnorm" in str(w.message)]


def _served() -> list[str]:
    from arnorm.integrations import vllm as av

    return sorted(p for paths in av.served_calls(reset=True).values() for p in paths)


def check_probe() -> dict[str, Any]:
    """Item 5: a GemmaRMSNorm whose forward a monitoring wrapper holds (a closure over the original
    module), a GemmaRMSNorm subclass with its own forward, a plain norm of a neutral class name
    handed to the Gemma helper: each gets vLLM's own result and one warning naming it."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    from arnorm.integrations import vllm as av

    vllm_gemma, _ = _vllm_helpers()
    out: dict[str, Any] = {}

    wrapped = _gemma()
    original = wrapped.forward

    @functools.wraps(original)
    def monitored(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    wrapped.forward = monitored

    class ScaledGemmaRMSNorm(GemmaRMSNorm):
        def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
            y, h = super().forward(x, residual)
            return (y.float() * 1.25).to(y.dtype), h

    sub = ScaledGemmaRMSNorm(H, EPS)
    sub.weight.data = _gemma().weight.data.clone()

    # A neutral class name, but a plain norm (weight multiplies), handed to the Gemma helper.
    neutral = type("Norm", (torch.nn.Module,), {})()
    plain = RMSNorm(H, EPS).to(torch.bfloat16)
    with torch.no_grad():
        plain.weight.data = (_gemma().weight.data.float() + 1).to(torch.bfloat16)
    neutral.weight, neutral.variance_epsilon = plain.weight, EPS
    neutral.forward_native = plain.forward_native
    type(neutral).forward = lambda self, x, residual=None: self.forward_native(x, residual)

    for name, norm in (("wrapped", wrapped), ("subclass", sub), ("neutral_plain", neutral)):
        x, residual = _rows(4, torch.bfloat16, 7)
        want = vllm_gemma(x.clone(), residual.clone(), norm)
        got, said = _call(av.fused_allreduce_gemma_rms_norm, x.clone(), residual.clone(), norm)
        again, said_again = _call(av.fused_allreduce_gemma_rms_norm, x.clone(), residual.clone(), norm)
        out[name] = {
            "bitwise_vllm": _same(got, want) and _same(again, want),
            "warnings": said, "warnings_again": said_again, "served": _served(),
        }  # fmt: skip
    return out


def check_known() -> dict[str, Any]:
    """Item 5: what arnorm takes vLLM 0.33's norms to compute where it cannot probe, per platform."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    try:
        from arnorm.integrations._vllm_norms import known_arithmetic
    except ImportError as exc:
        return {"error": str(exc)}

    plain = RMSNorm(H, EPS).to(torch.bfloat16)
    plain32 = RMSNorm(H, EPS)

    class MyRMSNorm(RMSNorm):
        pass

    def say(norm: Any, offset: float, device: str) -> Any:
        arith, _ = known_arithmetic(norm, offset, torch.bfloat16, torch.device(device))
        return None if arith is None else [arith.round_before_weight, arith.normalize_unrounded]

    return {
        "plain_cuda": say(plain, 0.0, "cuda"),
        "plain_fp32_weight_cuda": say(plain32, 0.0, "cuda"),
        "plain_cpu": say(plain, 0.0, "cpu"),
        "gemma_cuda": say(GemmaRMSNorm(H, EPS), 1.0, "cuda"),
        "gemma_cpu": say(GemmaRMSNorm(H, EPS), 1.0, "cpu"),
        "subclass_cuda": say(MyRMSNorm(H, EPS), 0.0, "cuda"),
        "plain_xpu": say(plain, 0.0, "xpu"),
    }


def check_reloaded_weight() -> dict[str, Any]:
    """Item 7a: an fp32 GemmaRMSNorm weight with bf16 activations, reloaded through vLLM's
    default_weight_loader (param.data.copy_, no version bump) after a first fused call."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from arnorm.integrations import vllm as av

    vllm_gemma, _ = _vllm_helpers()
    norm = _gemma(torch.float32)
    x, residual = _rows(4, torch.bfloat16, 11)
    _call(av.fused_allreduce_gemma_rms_norm, x.clone(), residual.clone(), norm)
    served_first = _served()
    version = norm.weight._version
    new = (torch.randn(H, generator=torch.Generator().manual_seed(99)) * 2).to(torch.bfloat16).float()
    default_weight_loader(norm.weight, new)
    want = vllm_gemma(x.clone(), residual.clone(), norm)
    got, _ = _call(av.fused_allreduce_gemma_rms_norm, x.clone(), residual.clone(), norm)
    return {
        "version_moved": norm.weight._version != version,
        "served_first": served_first,
        "served": _served(),
        "bitwise_vllm": _same(got, want),
        "max_diff": float((got[0].float() - want[0].float()).abs().max()),
    }


def check_returns() -> dict[str, Any]:
    """Items 7c, 7d: residual=None at several T, and mixed fp32/bf16 x and residual: what vLLM's own
    helpers return (types, shapes, dtypes, values) at TP 1."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    from arnorm.integrations import vllm as av

    vllm_gemma, vllm_plain = _vllm_helpers()
    gemma = _gemma()
    plain = RMSNorm(H, EPS).to(torch.bfloat16)
    out: dict[str, Any] = {"none": {}, "mixed": {}}
    for kind, norm, theirs, ours in (
        ("gemma", gemma, vllm_gemma, av.fused_allreduce_gemma_rms_norm),
        ("plain", plain, vllm_plain, av.fused_allreduce_rms_norm),
    ):
        for tokens in (1, 2, 7):
            x, _ = _rows(tokens, torch.bfloat16, tokens)
            want = theirs(x.clone(), None, norm)
            try:
                got = ours(x.clone(), None, norm)
                out["none"][f"{kind}/{tokens}"] = _same(got, want)
            except Exception as exc:
                out["none"][f"{kind}/{tokens}"] = f"{type(exc).__name__}: {exc}"
        for xd, rd in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
            x, residual = _rows(7, torch.bfloat16, 5)
            x, residual = x.to(xd), residual.to(rd)
            want = theirs(x.clone(), residual.clone(), norm)
            got = ours(x.clone(), residual.clone(), norm)
            out["mixed"][f"{kind}/{xd}/{rd}"] = {
                "dtypes": [str(t.dtype) for t in got], "vllm_dtypes": [str(t.dtype) for t in want],
                "bitwise_vllm": _same(got, want),
            }  # fmt: skip
    return out


def edges(rank: int, world: int) -> dict[str, Any]:
    """Items 5 and 7a-d on vLLM's TP 1 group, arnorm's triton backend serving (interpreted)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from arnorm.integrations import vllm as av

    with vllm_parallel_state(rank, world):
        av.configure(max_tokens=32, backend=["triton", "reference"])
        report = {}
        for name, check in (("probe", check_probe), ("known", check_known),
                            ("reloaded", check_reloaded_weight), ("returns", check_returns)):  # fmt: skip
            try:
                report[name] = check()
            except Exception as exc:  # reported, so the other checks still run
                report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        av.configure()
    return report


def one_rank_disabled(rank: int, world: int) -> Any:
    """Item 7e: ARNORM_VLLM=0 on rank 0 only (the env run_ranks gives each rank): arnorm's plugin
    registers, then each rank calls the Gemma helper by its module's name, as a model file does.
    What each got, and how long it took."""
    import importlib
    import time

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from arnorm.integrations import _vllm_plugin
    from arnorm.integrations import vllm as av

    module = importlib.import_module("vllm.model_executor.layers.fused_allreduce_gemma_rms_norm")
    _vllm_plugin.register()
    with vllm_parallel_state(rank, world):
        av.configure(max_tokens=32, backend=["triton", "reference"])
        norm = _gemma()
        x, residual = _rows(4, torch.bfloat16, 21)
        t0 = time.monotonic()
        try:
            module.fused_allreduce_gemma_rms_norm(x, residual, norm)
            got: tuple[str, ...] = ("ok",)
        except Exception as exc:
            got = ("error", type(exc).__name__, str(exc))
        took = time.monotonic() - t0
        av.configure()
    return got, took
