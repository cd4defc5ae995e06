"""arnorm.integrations.vllm: the seeds' entry points, their return contracts, where the TP group is from."""

from __future__ import annotations

import sys
import warnings

import integ_fakes
import pytest
import torch

import arnorm
from arnorm.integrations import _common as integ_common
from arnorm.integrations import _vllm_groups as vllm_groups
from arnorm.integrations import vllm as av
from arnorm.integrations._vllm_keys import format_of_key
from arnorm.testing import run_ranks


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Each test starts unconfigured, with vllm looked up afresh, no op cached, and the test backends."""
    integ_fakes.install_registry()
    monkeypatch.setattr(vllm_groups, "VLLM_STATE", [])
    for name in ("vllm", "vllm.distributed", "vllm.distributed.parallel_state"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(integ_common, "_WARNED", set())
    av.configure()
    yield
    av.configure()


@pytest.mark.slow
@pytest.mark.parametrize(("world", "dtype"), [(2, "bfloat16"), (4, "bfloat16"), (2, "float32")])
def test_entry_points_match_the_unfused_path_on_ranks(world, dtype):
    """On 2 and 4 gloo ranks every entry point equals all_reduce + GemmaRMSNorm (+ arnorm.quant) bit for
    bit, is fused exactly where a fused backend serves, and returns None exactly where none does."""
    results = run_ranks(world, integ_vllm_rank("entry_points"), dtype, timeout=120)
    assert results[0]["paths"] == ["1:fused", "5:fused", "16:fused", "20:unfused", "40:unfused"]
    assert results[0]["formats"] == ["fp8_static", "fp8_per_token", "nvfp4", "mxfp8"]


def integ_vllm_rank(name):
    import integ_vllm_ranks

    return getattr(integ_vllm_ranks, name)


def test_quant_keys_map_by_their_fields():
    """vLLM QuantKeys (by structure) and arnorm format names map to formats; anything else to None."""
    for fmt, key in {**integ_fakes.KEYS, **integ_fakes.GROUP_KEYS}.items():
        assert format_of_key(key) == fmt
        assert format_of_key(fmt) == fmt
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None:
        key = integ_fakes.QuantKey(torch.float8_e4m3fn, integ_fakes.ScaleDesc(e8m0, False, (1, 32)))
        assert format_of_key(key) == "mxfp8"
    for name, key in integ_fakes.UNSUPPORTED.items():
        assert format_of_key(key) is None, name
    assert format_of_key(object()) is None


def test_without_vllm_or_configure_the_error_names_both():
    """With vllm not importable and no configure(), a call says how to give a group."""
    sys.modules["vllm"] = None  # type: ignore[assignment]  # import vllm raises ImportError
    try:
        x = torch.zeros(2, 8)
        norm = integ_fakes.HFGemmaNorm(torch.zeros(8), 1e-6)
        with pytest.raises(
            arnorm.InvalidInputError, match=r"^group: none configured and vllm is not importable"
        ):
            av.fused_allreduce_gemma_rms_norm(x, x.clone(), norm)
    finally:
        del sys.modules["vllm"]


def test_vllm_without_initialized_groups_is_an_error():
    """vllm importable but its TP group not initialized: the error says so and names configure()."""
    integ_fakes.install_vllm(None)
    x = torch.zeros(2, 8)
    with pytest.raises(arnorm.InvalidInputError, match=r"vLLM's tensor-parallel group is not initialized"):
        av.fused_allreduce_gemma_rms_norm(x, x.clone(), integ_fakes.HFGemmaNorm(torch.zeros(8), 1e-6))


def test_vllm_tp1_group_is_local():
    """vLLM at TP 1: the op is a single-process one and the result is the plain add + Gemma norm."""
    integ_fakes.install_vllm(integ_fakes.Coordinator(None, None, 1))
    g = torch.Generator().manual_seed(3)
    x, residual, weight = (torch.randn(4, 32, generator=g) for _ in range(3))
    weight = weight[0]
    h = x + residual
    want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight)).to(h.dtype)
    normed, new_residual = av.fused_allreduce_gemma_rms_norm(
        x.clone(), residual, integ_fakes.HFGemmaNorm(weight, 1e-6)
    )
    assert torch.equal(new_residual, h) and torch.equal(normed, want)
    assert av.op_for(32, torch.float32, 1e-6, device="cpu").problem.world_size == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group": "tp"}, r"^group: str \(needs a torch.distributed ProcessGroup, arnorm.LOCAL"),
        ({"group": arnorm.LOCAL, "max_tokens": 0}, r"^max_tokens: 0 \(needs a positive int or None\)"),
        ({"group": arnorm.LOCAL, "max_tokens": True}, r"^max_tokens: True "),
    ],
)
def test_configure_rejects_bad_arguments(kwargs, message):
    """configure() names the bad argument, what it got, and what it needs."""
    with pytest.raises(arnorm.InvalidInputError, match=message):
        av.configure(**kwargs)


def test_norm_without_eps_is_rejected():
    """A norm module with neither variance_epsilon nor eps is refused with its class name."""
    av.configure(group=arnorm.LOCAL)
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.zeros(8))
    x = torch.zeros(2, 8)
    with pytest.raises(arnorm.InvalidInputError, match=r"^norm: Module \(needs a module with a weight"):
        av.fused_allreduce_gemma_rms_norm(x, x.clone(), norm)


def test_inputs_an_op_cannot_take_run_unfused_or_return_none():
    """3-D or strided inputs get (normed, residual) from the unfused path and the quant entry returns
    None, each saying why once (an ArnormWarning naming the argument, what it is and what it needs)."""
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    g = torch.Generator().manual_seed(5)
    x, residual = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    weight = torch.randn(16, generator=g) * 0.1
    h = x + residual
    want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight)).to(h.dtype)
    with pytest.warns(arnorm.ArnormWarning, match=r"rms_norm: ran unfused: hidden_states: shape \(2, 3, 16\) "
                                                  r"\(needs 2-D \[T, H\]\)$"):  # fmt: skip
        normed, new_residual = av.fused_allreduce_gemma_rms_norm(
            x, residual, integ_fakes.HFGemmaNorm(weight, 1e-6)
        )
    assert torch.equal(normed, want) and torch.equal(new_residual, h)
    wide = torch.randn(4, 32, generator=g)
    strided = wide[:, :16]
    with pytest.warns(arnorm.ArnormWarning, match=r"quant: ran unfused: hidden_states: strides \(32, 1\) "):
        got = av.fused_allreduce_gemma_rms_norm_quant(
            strided, strided.clone(), weight, 1e-6, None, "fp8_per_token"
        )
    assert got is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the same reason again is silent, and 0 tokens always
        assert (
            av.fused_allreduce_gemma_rms_norm_quant(strided, strided.clone(), weight, 1e-6, None, "nvfp4")
            is None
        )
        empty = torch.zeros(0, 16)
        assert av.fused_allreduce_gemma_rms_norm_quant(empty, empty, weight, 1e-6, None, "nvfp4") is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_unfused_path_returns_the_norms_own_dtypes(dtype):
    """A vLLM Gemma norm that returns an fp32 residual for fp16 gets vLLM's own path, and its return as
    it is (vLLM's helper returns ``norm(reduced, residual)``: casting the residual back to the
    caller's dtype gave results vLLM does not); bf16 fuses."""
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    g = torch.Generator().manual_seed(9)

    class Fp32ResidualGemmaNorm(integ_fakes.VllmGemmaNorm):  # probed per class: a class of its own
        fp32_residual_in_fp16 = True

    norm = Fp32ResidualGemmaNorm((torch.randn(16, generator=g) * 0.1).to(dtype), 1e-6)
    over = integ_fakes.FUSED_LIMIT + 4  # only the reference serves it: the unfused path
    x, residual = (torch.randn(over, 16, generator=g).to(dtype) for _ in range(2))
    if dtype == torch.float16:
        with pytest.warns(
            arnorm.ArnormWarning,
            match=r"runs vLLM's own path, .*residual comes back torch.float32, not torch.float16",
        ):
            normed, new_residual = av.fused_allreduce_gemma_rms_norm(x.clone(), residual, norm)
    else:
        normed, new_residual = av.fused_allreduce_gemma_rms_norm(x.clone(), residual, norm)
    want_normed, want_residual = norm.forward_native(x, residual)
    assert norm.calls == 2 and torch.equal(normed, want_normed)
    assert new_residual.dtype == want_residual.dtype and torch.equal(new_residual, want_residual)
    x2 = torch.randn(4, 16, generator=g).to(dtype)
    av.fused_allreduce_gemma_rms_norm(x2, residual[:4].contiguous(), norm)
    assert norm.calls == (3 if dtype == torch.float16 else 2)  # fp16: vLLM's own path every call


class _WeightAndEps(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(weight, requires_grad=False), eps


@pytest.mark.parametrize("name", ["RMSNorm", "LlamaRMSNorm", "Qwen3RMSNorm", "RMSNormGated"])
def test_a_plain_rms_norm_is_refused(name):
    """A known plain norm class (x * weight), or a subclass of one, is refused before anything runs: the
    fused path would multiply by 1 + weight; a class named like Gemma passes even as such a subclass."""
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    plain = type(name, (_WeightAndEps,), {})
    sub = type("MyNorm", (plain,), {})
    gemma = type("MyGemmaRMSNorm", (plain,), {})
    x = torch.randn(4, 16)
    for cls in (plain, sub):
        refused = rf"^norm: {cls.__name__}, a plain RMSNorm that multiplies by weight \(needs a Gemma norm"
        with pytest.raises(arnorm.InvalidInputError, match=refused):
            av.fused_allreduce_gemma_rms_norm(x, x.clone(), cls(torch.zeros(16), 1e-6))
        with pytest.raises(arnorm.InvalidInputError, match=r"^norm: "):
            av.allreduce_gemma_rms_norm_mxfp8(
                torch.randn(4, 32), torch.randn(4, 32), cls(torch.zeros(32), 1e-6)
            )
    normed, _ = av.fused_allreduce_gemma_rms_norm(x.clone(), x.clone(), gemma(torch.zeros(16), 1e-6))
    assert normed.shape == (4, 16)


def test_a_hidden_size_the_format_cannot_split_returns_none():
    """mxfp8 at a hidden size that is not a multiple of 32: the quant entry points return None (once
    saying why), op_for raises the op's own error; the plain Gemma entry is fused as usual."""
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    x, residual = torch.randn(4, 48), torch.randn(4, 48)
    norm = integ_fakes.HFGemmaNorm(torch.zeros(48), 1e-6)
    with pytest.warns(
        arnorm.ArnormWarning, match=r"mxfp8: ran unfused: hidden_size: 48 \(needs a multiple of 32"
    ):
        assert av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual, norm) is None
    assert (
        av.fused_allreduce_gemma_rms_norm_quant(x.clone(), residual, norm.weight, 1e-6, None, "mxfp8") is None
    )
    with pytest.raises(arnorm.InvalidInputError, match=r"^hidden_size: 48 \(needs a multiple of 32"):
        av.op_for(48, torch.float32, 1e-6, key="mxfp8", device="cpu")
    assert av.op_for(48, torch.float32, 1e-6, device="cpu").backend_for(4) == "fused"


def test_warmup_builds_the_op_calls_use():
    """warmup() builds the op a later call with that configuration runs on; configure() closes it."""
    av.configure(group=arnorm.LOCAL, max_tokens=16)
    av.warmup(32, torch.float32, 1e-6, device="cpu")
    av.warmup(32, torch.float32, 1e-6, key="mxfp8", return_normed=False, device="cpu")
    op = av.op_for(32, torch.float32, 1e-6, device="cpu")
    assert op is not None and op.problem.max_tokens == 16 and len(av._ops) == 2
    assert av.op_for(32, torch.float32, 1e-6, key="int8") is None
    av.configure(group=arnorm.LOCAL)
    assert not av._ops and op._closed


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "cls", [integ_fakes.VllmGemmaNorm, integ_fakes.OldVllmGemmaNorm], ids=["v033", "old"]
)
def test_fused_path_follows_the_norms_arithmetic(cls, dtype):
    """Issue 35: with a fused backend serving, the drop-in computes the arithmetic of the norm it is
    handed (vLLM 0.33's GemmaRMSNorm normalizes the unrounded fp32 sum; older vLLM the rounded one):
    bitwise that module's own output below and above the fused backend's limit, so a step's result
    does not depend on whether its batch was fused."""
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    g = torch.Generator().manual_seed(11)
    norm = cls((torch.randn(256, generator=g) * 0.3).to(dtype), 1e-6)
    for tokens in (4, integ_fakes.FUSED_LIMIT + 4):
        x = (torch.randn(tokens, 256, generator=g) * 3).to(dtype)
        residual = torch.randn(tokens, 256, generator=g).to(dtype)
        calls = norm.calls
        want_y, want_h = norm.forward_native(x, residual)
        normed, new_residual = av.fused_allreduce_gemma_rms_norm(x.clone(), residual, norm)
        assert _bitwise(new_residual, want_h) and _bitwise(normed, want_y), (cls.__name__, tokens)
        fused = tokens <= integ_fakes.FUSED_LIMIT
        assert norm.calls == calls + (1 if fused else 2), "the fused path must not run the module"
    op = av.op_for(256, dtype, 1e-6, device="cpu", norm=norm)
    assert ("normalize_unrounded" in op.problem.norm_options) == cls.unrounded


def test_a_norm_no_arithmetic_matches_runs_vllms_own_path_said_once():
    """A norm whose arithmetic arnorm cannot reproduce used to run fused with the nearest arithmetic
    (off by up to 5.2): now vLLM's own path (the module's result), one ArnormWarning naming it and
    what differs."""

    class ScaledGemmaRMSNorm(integ_fakes.VllmGemmaNorm):
        def forward_native(self, x, residual=None):
            y, h = super().forward_native(x, residual)
            return (y.float() * 1.5).to(x.dtype), h

    av.configure(group=arnorm.LOCAL, max_tokens=64)
    norm = ScaledGemmaRMSNorm(torch.zeros(64, dtype=torch.bfloat16), 1e-6)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.warns(
        arnorm.ArnormWarning,
        match=r"ScaledGemmaRMSNorm \(torch.bfloat16\) runs vLLM's own path, not fused: no arnorm arithmetic "
        r"is its own, bit for bit: \d+ of \d+ normed values",
    ):
        got = av.fused_allreduce_gemma_rms_norm(x.clone(), x.clone(), norm)
    want = norm(x.clone(), x.clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calls = norm.calls
        av.fused_allreduce_gemma_rms_norm(x.clone(), x.clone(), norm)
        assert norm.calls == calls + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_allreduce_rms_norm_for_vllms_plain_norm(dtype):
    """vLLM 0.33's plain helper: (normed, residual) bitwise vLLM's RMSNorm (unrounded sum, rounded
    before the weight), fused and unfused; a Gemma norm is refused; var_hidden_size runs unfused."""
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    g = torch.Generator().manual_seed(13)
    norm = integ_fakes.VllmPlainNorm((torch.randn(128, generator=g) * 0.3 + 1).to(dtype), 1e-6)
    for tokens in (3, integ_fakes.FUSED_LIMIT + 1):
        x, residual = ((torch.randn(tokens, 128, generator=g) * 2).to(dtype) for _ in range(2))
        want_y, want_h = integ_fakes.VllmPlainNorm(norm.weight.data, 1e-6).forward_native(x, residual)
        normed, new_residual = av.fused_allreduce_rms_norm(x.clone(), residual, norm)
        assert _bitwise(normed, want_y) and _bitwise(new_residual, want_h), tokens
    assert norm.calls == 1  # the over-limit call only
    problem = av.op_for(128, dtype, 1e-6, device="cpu", norm=norm).problem
    assert (problem.weight_offset, problem.norm_options) == (
        0.0,
        {"round_before_weight", "normalize_unrounded"},
    )
    with pytest.raises(arnorm.InvalidInputError, match=r"^norm: VllmGemmaNorm, a Gemma norm that multiplies"):
        av.fused_allreduce_rms_norm(x, residual, integ_fakes.VllmGemmaNorm(norm.weight.data, 1e-6))
    norm.variance_size_override = 64
    with pytest.warns(
        arnorm.ArnormWarning,
        match=r"rms_norm: ran unfused: norm: RMSNorm with the statistic over the first 64",
    ):
        av.fused_allreduce_rms_norm(x[:2].clone(), residual[:2], norm)


def test_quant_entry_returns_vllms_quantized_activation_fields():
    """Issue 35: the quant entry point returns vLLM's QuantizedActivation (here, without vllm, the
    stand-in of the same fields): data, scale, orig_dtype, orig_shape, quant_key."""
    from arnorm.integrations import _vllm_types

    av.configure(group=arnorm.LOCAL, max_tokens=64)
    x, residual = torch.randn(4, 64).to(torch.bfloat16), torch.randn(4, 64).to(torch.bfloat16)
    weight = torch.zeros(64, dtype=torch.bfloat16)
    scale = torch.tensor(0.05)
    key = integ_fakes.KEYS["fp8_static"]
    q, _, _ = av.fused_allreduce_gemma_rms_norm_quant(x, residual, weight, 1e-6, scale, key)
    assert type(q).__name__ in ("QuantizedActivation", "QuantizedActivationStandIn")
    if _vllm_types._vllm() is None:
        assert isinstance(q, _vllm_types.QuantizedActivationStandIn)
    assert q.quant_key is key and q.scale is scale
    assert q.orig_dtype == torch.bfloat16 and q.orig_shape == torch.Size([4, 64])
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (4, 64)


def test_mxfp8_computes_where_no_fused_backend_serves():
    """Issue 35: allreduce_gemma_rms_norm_mxfp8 returns a result wherever arnorm can compute one (here
    above the fused backend's limit, at TP 1); None only where no path takes the inputs. Issue 44: called
    as the seed calls it, the scales are row-major E8M0 ``[T, H // 32]`` (the seed's documented return);
    128x4-swizzled (flat, what vLLM's FlashInfer mxfp8 linears read) only on request."""
    from arnorm.quant import quantize

    av.configure(group=arnorm.LOCAL, max_tokens=64)
    g = torch.Generator().manual_seed(17)
    tokens = integ_fakes.FUSED_LIMIT + 3
    x, residual = (torch.randn(tokens, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    norm = integ_fakes.VllmGemmaNorm((torch.randn(64, generator=g) * 0.2).to(torch.bfloat16), 1e-6)
    want_y, want_h = norm.forward_native(x, residual)
    got = av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual, norm, True)
    assert got is not None
    x_q, x_scale, normed, new_residual = got
    want = quantize(want_y, "mxfp8", layout="linear")
    assert _bitwise(x_q, want.data) and _bitwise(x_scale, want.scale)
    assert x_scale.shape == (tokens, 64 // 32) and x_scale.dtype == torch.uint8
    assert _bitwise(normed, want_y) and _bitwise(new_residual, want_h)
    seed_call = av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual, norm)
    assert seed_call is not None and _bitwise(seed_call[1], want.scale) and seed_call[2] is None
    swizzled = av.allreduce_gemma_rms_norm_mxfp8(x.clone(), residual, norm, scale_layout="swizzled_128x4")
    want_swizzled = quantize(want_y, "mxfp8", layout="swizzled_128x4").scale.reshape(-1)
    assert swizzled is not None and _bitwise(swizzled[1], want_swizzled) and swizzled[1].dim() == 1
    with pytest.raises(arnorm.InvalidInputError, match=r"^scale_layout: 'rows' \(needs 'linear' or"):
        av.allreduce_gemma_rms_norm_mxfp8(x, residual, norm, scale_layout="rows")


def test_a_format_vllm_does_not_name_keeps_the_callers_key(monkeypatch):
    """A format added to arnorm's table needs no line in the vLLM key names: vLLM's key where vLLM
    names the format, else the caller's own key, never a KeyError."""
    import types

    from arnorm.integrations import _vllm_types

    quant_utils = types.SimpleNamespace(kFp8StaticTensorSym="vllm-fp8-static-key")
    monkeypatch.setattr(_vllm_types, "_VLLM", [(object, quant_utils)])
    assert _vllm_types.vllm_key("fp8_static", "fp8_static") == "vllm-fp8-static-key"
    assert _vllm_types.vllm_key("new_format", "new_format") == "new_format"
    key = object()
    assert _vllm_types.vllm_key(key, "fp8_static") is key


@pytest.mark.parametrize("fmt", list(integ_fakes.GROUP_KEYS))
def test_quant_entry_serves_vllms_group_and_mx_keys(fmt):
    """kFp8Dynamic128Sym / kFp8Dynamic64Sym / kMxfp4Dynamic: the codes and the scales vLLM's block-FP8
    (and MX) linears read: row-major [T, H / group] (fp32, or E8M0 bytes for mxfp4), bit for bit
    arnorm.quant of vLLM's own unfused normed output."""
    from arnorm.quant import quantize

    av.configure(group=arnorm.LOCAL, max_tokens=64)
    g = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(5, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = (torch.randn(256, generator=g) * 0.2).to(torch.bfloat16)
    norm = integ_fakes.VllmGemmaNorm(weight, 1e-6)
    want_y, want_h = norm.forward_native(x.clone(), residual.clone())
    key = integ_fakes.GROUP_KEYS[fmt]
    got = av.fused_allreduce_gemma_rms_norm_quant(x.clone(), residual.clone(), weight, 1e-6, None, key)
    assert got is not None
    q, normed, new_residual = got
    want = quantize(want_y, fmt)
    assert q.quant_key is key and q.orig_shape == x.shape
    assert _bitwise(q.data, want.data) and _bitwise(q.scale, want.scale)
    group = {"fp8_per_group": 128, "fp8_per_group_64": 64, "mxfp4": 32}[fmt]
    assert q.scale.shape == (5, 256 // group) and q.scale.is_contiguous()
    assert _bitwise(normed, want_y) and _bitwise(new_residual, want_h)


def _plain_call(seed: int):
    g = torch.Generator().manual_seed(seed)
    norm = integ_fakes.VllmPlainNorm((torch.randn(128, generator=g) * 0.3 + 1).to(torch.bfloat16), 1e-6)
    x, residual = ((torch.randn(5, 128, generator=g) * 2).to(torch.bfloat16) for _ in range(2))
    want = integ_fakes.VllmPlainNorm(norm.weight.data, 1e-6).forward_native(x, residual)
    return norm, x, residual, want


def test_at_tp_1_the_fused_path_writes_over_both_inputs_as_vllms_norm():
    """vLLM's fused_add_rms_norm writes the normed output over x and the new residual over residual:
    at TP 1 the drop-in's op does the same (output_layout='in_place') where a backend writes that
    layout (triton here), with the same values."""
    from arnorm.registry._discovery import Registry, reset_registry
    from arnorm_triton._plugin import arnorm_backends as triton_backends

    reg = Registry()
    reg.add(triton_backends()[0], plugin="arnorm")
    reset_registry(reg)
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    norm, x, residual, (want_y, want_h) = _plain_call(17)
    xi, ri = x.clone(), residual.clone()
    normed, new_residual = av.fused_allreduce_rms_norm(xi, ri, norm)
    assert normed.data_ptr() == xi.data_ptr() and new_residual.data_ptr() == ri.data_ptr()
    assert _bitwise(normed, want_y) and _bitwise(new_residual, want_h)
    assert av.served_calls()["fused_allreduce_rms_norm"].get("triton") == 1


def test_without_a_backend_writing_the_in_place_layout_the_op_is_built_in_the_default_one():
    """The test registry's fused backend declares the separate layout only: the drop-in's op is
    built in it (the new residual over hidden_states, residual left as it was), same values."""
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    norm, x, residual, (want_y, want_h) = _plain_call(19)
    xi, ri = x.clone(), residual.clone()
    normed, new_residual = av.fused_allreduce_rms_norm(xi, ri, norm)
    assert new_residual.data_ptr() == xi.data_ptr() and torch.equal(ri, residual)
    assert _bitwise(normed, want_y) and _bitwise(new_residual, want_h)
    assert norm.calls == 0  # fused
