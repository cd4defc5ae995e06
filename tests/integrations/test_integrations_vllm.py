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
    for fmt, key in integ_fakes.KEYS.items():
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
def test_the_residual_keeps_its_dtype_on_both_paths(dtype):
    """A vLLM Gemma norm that returns an fp32 residual for fp16 (as vLLM's does) gets it back in the
    caller's dtype from the unfused path, so the next call still fuses; bf16 is untouched."""
    av.configure(group=arnorm.LOCAL, max_tokens=64)
    g = torch.Generator().manual_seed(9)
    norm = integ_fakes.VllmGemmaNorm((torch.randn(16, generator=g) * 0.1).to(dtype), 1e-6)
    norm.fp32_residual_in_fp16 = True
    over = integ_fakes.FUSED_LIMIT + 4  # only the reference serves it: the unfused path
    x, residual = (torch.randn(over, 16, generator=g).to(dtype) for _ in range(2))
    normed, new_residual = av.fused_allreduce_gemma_rms_norm(x.clone(), residual, norm)
    want_normed, want_residual = norm.forward_native(x, residual)
    assert norm.calls == 2 and torch.equal(normed, want_normed)
    assert new_residual.dtype == dtype and torch.equal(new_residual, want_residual.to(dtype))
    x2 = torch.randn(4, 16, generator=g).to(dtype)
    av.fused_allreduce_gemma_rms_norm(x2, new_residual[:4].contiguous(), norm)
    assert norm.calls == 2  # fused: the module did not run again


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
