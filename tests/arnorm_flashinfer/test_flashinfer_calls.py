"""What the backend passes to FlashInfer, per format, and how the buffers come back as ``Output``."""

from __future__ import annotations

import re

import pytest
import torch
from fake_flashinfer import FakeComm, P, TorchDistBackend, fake_fi_fixture, make_problem  # noqa: F401  (fixture)

from arnorm import quant as Q
from arnorm._errors import InvalidInputError
from arnorm._reference import add_rmsnorm, rank_order_sum
from arnorm_flashinfer import _workspace
from arnorm_flashinfer._backend import FlashInferBackend
from arnorm_flashinfer._plugin import FlashInferSettings

GRAMMAR = re.compile(r"^[^:]+: .+ \(needs .+\)$")


def build(config=None, comm=None, **overrides):
    problem = make_problem(**overrides)
    comm = comm or FakeComm(problem.world_size)
    return FlashInferBackend.create(problem, comm, config or FlashInferSettings()), problem, comm


def inputs(problem, tokens=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, problem.dtype)
    x = torch.randn(tokens, problem.hidden_size, generator=g).to(dt)
    res = torch.randn(tokens, problem.hidden_size, generator=g).to(dt)
    w = (torch.randn(problem.hidden_size, generator=g) * 0.1).to(dt)
    scale = torch.tensor([0.02]) if problem.quant in ("fp8_static", "nvfp4") else None
    return x, res, w, scale


def expected(problem, x, res, w, scale):
    """The kernel's result with every rank holding the same partial (what the fake assumes)."""
    h, y = add_rmsnorm(rank_order_sum([x] * problem.world_size), res, w, problem.eps, problem.weight_offset)
    q = (
        None
        if problem.quant is None
        else Q.quantize(y, problem.quant, scale=scale, layout=problem.scale_layout)
    )
    return h, y, q


def test_create_passes_the_tp_group_and_a_comm_backend_on_its_cpu_twin(fake_fi, clean_env):
    backend, _, comm = build()
    (kw,) = fake_fi.creates
    assert kw["backend"] == "trtllm"
    assert kw["world_size"] == 2 and kw["rank"] == 0
    assert kw["hidden_dim"] == 64 and kw["dtype"] is torch.bfloat16
    assert kw["group"] is comm.group
    assert isinstance(kw["comm_backend"], TorchDistBackend) and kw["comm_backend"].group is comm.cpu_group
    assert kw["max_token_num"] == 64  # min(64 MiB / (64 * 2 B), max_tokens=64)
    assert "gpus_per_node" not in kw and kw["_positional"] == ()
    # The JIT module is built before the collective creation, never inside it.
    assert fake_fi.events == ["build:trtllm", "create:trtllm"]
    assert len(comm.gathers) == 2  # topology agreed first, then the JIT build results
    assert backend.kind == "trtllm" and backend.capacity == 64


FORMATS = [
    # quant, normed_output, layout, pattern, layout code
    (None, True, None, P.kARResidualRMSNorm, None),
    ("fp8_static", True, None, P.kARResidualRMSNormOutFP8Quant, None),
    ("fp8_static", False, None, P.kARResidualRMSNormFP8Quant, None),
    ("fp8_per_token", True, None, P.kARResidualRMSNormOutDynamicFP8Quant, None),
    ("fp8_per_token", False, None, P.kARResidualRMSNormDynamicFP8Quant, None),
    ("nvfp4", True, "swizzled_128x4", P.kARResidualRMSNormOutFP4Quant, 0),
    ("nvfp4", False, "linear", P.kARResidualRMSNormFP4Quant, 2),
    ("mxfp8", True, "linear", P.kARResidualRMSNormOutMXFP8Quant, 2),
    ("mxfp8", False, "swizzled_128x4", P.kARResidualRMSNormMXFP8Quant, 0),
]


@pytest.mark.parametrize(("quant", "normed", "layout", "pattern", "code"), FORMATS)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_keywords_per_format(fake_fi, clean_env, quant, normed, layout, pattern, code, offset):
    arch = (10, 0) if quant == "nvfp4" else (9, 0)
    backend, problem, _ = build(
        quant=quant, normed_output=normed, scale_layout=layout, arch=arch, weight_offset=offset, eps=1e-5
    )
    x, res, w, scale = inputs(problem)
    backend(x, res, w, scale)
    kw = fake_fi.last_call
    assert kw["_positional"] == ()
    assert kw["pattern"] == pattern
    assert kw["input"] is x and kw["residual_in"] is res and kw["rms_gamma"] is w
    assert (
        kw["residual_out"] is x and kw["output"] is x
    )  # in place; output is never written by these patterns
    assert kw["launch_with_pdl"] is False
    assert "trigger_completion_at_end" not in kw  # left at FlashInfer's default (True)
    assert kw["use_oneshot"] is True and kw["fp32_acc"] is True
    assert kw["weight_bias"] == offset and kw["rms_eps"] == 1e-5
    assert kw["layout_code"] == code
    if quant in ("fp8_static", "nvfp4"):
        assert kw["scale_factor"] is scale  # the caller's fp32 [1] device tensor: graph-safe
    else:
        assert kw["scale_factor"] is None
    assert (kw["norm_out"] is not None) == (normed or quant is None)
    assert set(kw) >= {"quant_out", "scale_out"} or quant in (None, "fp8_static")


@pytest.mark.parametrize(("quant", "normed", "layout", "pattern", "code"), FORMATS)
def test_buffers_and_output_mapping(fake_fi, clean_env, quant, normed, layout, pattern, code):
    arch = (10, 0) if quant == "nvfp4" else (9, 0)
    backend, problem, _ = build(
        quant=quant, normed_output=normed, scale_layout=layout, arch=arch, hidden_size=96
    )
    x, res, w, scale = inputs(problem, tokens=7)
    h, y, q = expected(problem, x, res, w, scale)
    out = backend(x, res, w, scale)
    kw = fake_fi.last_call
    t, hid = x.shape
    assert out.residual is x and torch.equal(out.residual, h)
    if normed:
        assert (
            out.normed is kw["norm_out"] and out.normed.dtype == torch.bfloat16 and torch.equal(out.normed, y)
        )
    else:
        assert out.normed is None
    if quant is None:
        assert out.quant is None
        return
    qa = out.quant
    assert qa.format == quant and qa.layout == layout
    assert qa.data is kw["quant_out"] and kw["quant_out"].is_contiguous()
    if quant == "fp8_static":
        assert qa.data.shape == (t, hid) and qa.data.dtype == torch.float8_e4m3fn
        assert qa.scale is scale and qa.global_scale is None
    elif quant == "fp8_per_token":
        assert qa.data.dtype == torch.float8_e4m3fn
        assert qa.scale is kw["scale_out"] and qa.scale.shape == (t, 1) and qa.scale.dtype == torch.float32
    elif quant == "nvfp4":
        assert qa.data.shape == (t, hid // 2) and qa.data.dtype == torch.uint8
        assert qa.global_scale is scale and qa.scale.dtype == torch.float8_e4m3fn
        shape = (128, 8) if layout == "swizzled_128x4" else (t, hid // 16)
        assert qa.scale.shape == shape
    else:
        assert qa.data.shape == (t, hid) and qa.data.dtype == torch.float8_e4m3fn
        assert qa.scale.dtype == torch.uint8
        assert qa.scale.shape == ((128, 4) if layout == "swizzled_128x4" else (t, hid // 32))
    if quant in ("nvfp4", "mxfp8"):
        flat = kw["scale_out"]
        assert flat.dim() == 1 and flat.numel() == qa.scale.numel()
        assert flat.data_ptr() == qa.scale.data_ptr()  # a view: FlashInfer's bytes are the result
    # Bit for bit what arnorm's quantizer produces from the normed values, in arnorm's shapes.
    assert torch.equal(qa.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(qa.scale.view(torch.uint8), q.scale.view(torch.uint8))
    assert torch.equal(Q.dequantize(qa), Q.dequantize(q))


def test_swizzled_padding_is_zero_even_though_the_kernel_skips_it(fake_fi, clean_env):
    backend, problem, _ = build(quant="nvfp4", arch=(10, 0), hidden_size=48)
    x, res, w, scale = inputs(problem, tokens=3)
    out = backend(x, res, w, scale)
    raw = out.quant.scale.view(torch.uint8)
    assert raw.shape == (128, 4)
    # rows 3..127 and column 3 of each row are padding (3 scale columns): zero-filled by us.
    linear = Q.unswizzle_128x4(raw, 128, 4)
    assert torch.count_nonzero(linear[3:]) == 0 and torch.count_nonzero(linear[:, 3]) == 0


def test_not_in_place_leaves_hidden_states_alone(fake_fi, clean_env):
    backend, problem, _ = build(inplace=False)
    x, res, w, scale = inputs(problem)
    x0 = x.clone()
    h, _, _ = expected(problem, x, res, w, scale)
    out = backend(x, res, w, scale)
    kw = fake_fi.last_call
    assert torch.equal(x, x0)
    assert out.residual is kw["residual_out"] and out.residual is not x and torch.equal(out.residual, h)
    assert kw["output"] is out.residual


@pytest.mark.parametrize(("quant", "normed", "layout", "pattern", "code"), FORMATS)
def test_in_place_layout_aliases_the_inputs_as_vllm_does(
    fake_fi, clean_env, quant, normed, layout, pattern, code
):
    """output_layout='in_place': residual_out is residual_in and norm_out is input (vLLM's aliasing),
    no [T, H] buffer allocated, the values those of the separate layout."""
    arch = (10, 0) if quant == "nvfp4" else (9, 0)
    backend, problem, _ = build(quant=quant, normed_output=normed, scale_layout=layout, arch=arch,
                                hidden_size=96, output_layout="in_place")  # fmt: skip
    x, res, w, scale = inputs(problem, tokens=7)
    h, y, q = expected(problem, x, res, w, scale)
    out = backend(x, res, w, scale)
    kw = fake_fi.last_call
    assert kw["pattern"] == pattern
    assert kw["residual_out"] is res and kw["residual_in"] is res and kw["output"] is res
    assert out.residual is res and torch.equal(res, h)
    if normed or quant is None:
        assert kw["norm_out"] is x
    else:
        assert kw["norm_out"] is None
    if normed:
        assert out.normed is x and torch.equal(x, y)
    else:
        assert out.normed is None
    if quant is not None:
        assert torch.equal(out.quant.data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(out.quant.scale.view(torch.uint8), q.scale.view(torch.uint8))


def test_in_place_layout_is_declared():
    from arnorm_flashinfer._plugin import CAPABILITIES

    assert CAPABILITIES.output_layouts == {"separate", "in_place"}


def test_weight_dtype_must_match(fake_fi, clean_env):
    backend, problem, _ = build()
    x, res, w, scale = inputs(problem)
    with pytest.raises(
        InvalidInputError, match=r"^weight: dtype torch.float32 \(needs torch.bfloat16"
    ) as err:
        backend(x, res, w.float(), scale)
    assert GRAMMAR.match(str(err.value))


def test_check_tokens(fake_fi, clean_env):
    backend, _, _ = build(max_tokens=1000, hidden_size=1024, config=FlashInferSettings(max_size_mb=0.5))
    assert backend.capacity == 256  # 0.5 MiB / (1024 * 2 B)
    assert backend.check_tokens(256) == ()
    (r0,) = backend.check_tokens(0)
    (r1,) = backend.check_tokens(257)
    assert r0 == "tokens: 0 (needs >= 1)"
    assert r1.startswith("tokens: 257 (needs <= 256: the workspace holds 0.5 MiB per rank")
    assert GRAMMAR.match(r1)
    ws = fake_fi.workspaces[0]
    assert ws.sufficient_calls[-1] == (2, 256, 1024, torch.bfloat16)


def test_check_tokens_asks_flashinfer(fake_fi, clean_env, monkeypatch):
    backend, _, _ = build()
    monkeypatch.setattr(fake_fi.workspaces[0], "is_buffer_size_sufficient", lambda *a: False)
    (reason,) = backend.check_tokens(8)
    assert "is_buffer_size_sufficient said no" in reason and GRAMMAR.match(reason)


def test_oneshot_is_explicit_and_follows_the_table(fake_fi, clean_env):
    arch = (9, 0)
    assert _workspace.use_oneshot(2, 4096, 2, 2, arch) is True  # tokens <= ranks: two-shot impossible
    assert _workspace.use_oneshot(4096, 4096, 2, 2, arch) is True  # 32 MiB: the sm90/tp2 limit
    assert _workspace.use_oneshot(4097, 4096, 2, 2, arch) is False
    assert _workspace.use_oneshot(64, 4096, 2, 8, arch) is True  # 0.5 MiB at tp8
    assert _workspace.use_oneshot(65, 4096, 2, 8, arch) is False
    assert _workspace.use_oneshot(100000, 4096, 2, 16, arch) is False  # beyond FlashInfer's Lamport clamp
    assert _workspace.use_oneshot(4000, 4096, 2, 16, arch) is True  # no tp16 entry: one-shot (vLLM)
    backend, problem, _ = build(
        max_tokens=64, hidden_size=8192, world_size=8, config=FlashInferSettings(max_size_mb=1)
    )
    x, res, w, scale = inputs(problem, tokens=40)  # 640 KiB > 0.5 MiB: two-shot
    backend(x, res, w, scale)
    assert fake_fi.last_call["use_oneshot"] is False


def test_fp32_at_tp2_allocates_room_for_two_shot(fake_fi, clean_env):
    build(dtype="float32", max_tokens=32)
    build(dtype="float32", max_tokens=32, world_size=4)
    assert [c["max_token_num"] for c in fake_fi.creates] == [64, 32]


def test_closed_backend(fake_fi, clean_env):
    backend, problem, _ = build()
    x, res, w, scale = inputs(problem)
    backend.close()
    backend.close()
    assert backend.check_tokens(4) == ("workspace: closed (needs a new op)",)
    with pytest.raises(InvalidInputError, match="closed"):
        backend(x, res, w, scale)
