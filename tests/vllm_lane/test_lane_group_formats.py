"""The per-token-group fp8 formats and mxfp4 bit for bit against vLLM 0.33's own quantizers.

vLLM's ``per_token_group_quant_fp8`` (every flag: group 128 and 64, ``use_ue8m0``, row-major,
column-major and TMA-aligned scales) and ``mxfp4_quantize`` run their Triton kernels under the
interpreter (``CUDA_VISIBLE_DEVICES`` empty, ``TRITON_INTERPRET=1``: tests/vllm_lane/run.sh sets
it). Two things of the interpreter are mended first, each a fault of the interpreter and not of
vLLM's arithmetic, so the judge is vLLM's kernels as a GPU runs them:

* its fp32 -> e4m3 cast rounds ties up and drops a mantissa carry (125.8 becomes 64, not 128);
  a GPU's ``cvt.rn.satfinite`` does neither, so the cast is torch's (round to nearest even; vLLM
  clamps to +-448 before it);
* ``tensor.floor()`` (vLLM's mxfp4 kernel calls ``tl.log2(x).floor()``) is missing from Triton
  3.8's interpreter; ``tl.math.floor`` is the same operation.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM lane needs vllm (tests/vllm_lane/run.sh)")

from arnorm import quant

# NaN and inf inputs make the interpreter's numpy warn (an invalid division, nanmax of all-NaN).
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture(scope="module", autouse=True)
def _interpreter_mended():
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.float8e4nv:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        return original(data, src, dst, rounding_mode)

    had_floor = hasattr(tl.core.tensor, "floor")
    floor = getattr(tl.core.tensor, "floor", None)
    interpreter._convert_float = convert
    tl.core.tensor.floor = lambda self: tl.math.floor(self)
    yield
    interpreter._convert_float = original
    if had_floor:
        tl.core.tensor.floor = floor


def _inputs(t: int, h: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)
    x = x.to(dtype)
    x[0, : min(h, 128)] = 0  # a zero group
    if t > 2:
        x[1, 5] = float("nan")
        x[2, 7] = float("inf")
        x[2, 9] = -float("inf")
    if t > 4:
        x[3, :32] = float("nan")  # an all-NaN block / part of a group
        x[4, 3] = 3e38 if dtype == torch.bfloat16 else 6e4  # saturation
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.uint8)


GROUP_CASES = [
    ("fp8_per_group", 128, False),
    ("fp8_per_group_64", 64, False),
    ("fp8_per_group_ue8m0", 128, True),
    ("fp8_per_group_64_ue8m0", 64, True),
]


@pytest.mark.parametrize(("fmt", "group", "ue8m0"), GROUP_CASES)
@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_token_group_fp8_matches_vllm(fmt, group, ue8m0, t, dtype):
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    x = _inputs(t, 512, t, dtype)
    for column_major, tma, layout in [
        (False, False, "linear"),
        (True, False, "column_major"),
        (True, True, "column_major_tma"),
    ]:
        q, s = per_token_group_quant_fp8(
            x, group, column_major_scales=column_major, tma_aligned_scales=tma, use_ue8m0=ue8m0
        )
        ours = quant.quantize(x, fmt, layout=layout)
        assert torch.equal(_bits(q), _bits(ours.data)), layout
        if layout == "linear":
            assert torch.equal(_bits(s), _bits(ours.scale))
        else:  # vLLM's [T, C] view of column-major storage; ours is that storage, [C, T or round_up(T, 4)]
            assert s.stride(0) == 1 and s.stride(1) == ours.scale.shape[1]
            assert torch.equal(_bits(s.t()), _bits(ours.scale[:, :t]))


@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_ue8m0_holds_vllms_exponents(t, dtype):
    """The packed layout's bytes are the exponents of vLLM's UE8M0 scales (its packed quantizer is a
    CUDA kernel only: the judge is its fp32 power-of-two scales)."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    x = _inputs(t, 640, t, dtype)  # 5 groups of 128: two int32 per token, the second padded
    q, s = per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    ours = quant.quantize(x, "fp8_per_group_ue8m0", layout="packed_ue8m0")
    assert torch.equal(_bits(q), _bits(ours.data))
    exps = (s.view(torch.int32) >> 23) & 0xFF
    raw = ours.scale.view(torch.uint8).view(2, -1, 4)  # [k, rows, byte]
    assert torch.equal(raw[0, :t], exps[:, :4].to(torch.uint8))
    assert torch.equal(raw[1, :t, 0], exps[:, 4].to(torch.uint8))
    assert raw[1, :, 1:].eq(0).all()


def test_scales_rounded_up_not_down():
    """vLLM's docstring says UE8M0 rounds each scale down to a power of two; its kernels round up
    (``exp2(ceil(log2(s)))``), as arnorm does: a group of maximum 3 gets 2**-7, not 2**-8."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 0] = 3
    _, s = per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    assert s.item() == 2.0**-7 == quant.quantize(x, "fp8_per_group_ue8m0").scale.item()


@pytest.mark.parametrize("t", [1, 7, 33, 130])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp4_matches_vllm(t, dtype):
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import mxfp4_quantize

    x = _inputs(t, 256, t, dtype)
    q, s = mxfp4_quantize(x)
    ours = quant.quantize(x, "mxfp4")
    assert torch.equal(_bits(q), _bits(ours.data))
    assert torch.equal(_bits(s), _bits(ours.scale))
    swizzled = quant.quantize(x, "mxfp4", layout="swizzled_128x4")
    assert torch.equal(quant.unswizzle_128x4(swizzled.scale, t, 8), ours.scale)


def test_mxfp4_every_e2m1_boundary_matches_vllm():
    """Each e2m1 rounding boundary, its fp32 neighbours and both signs, in blocks of scale 1."""
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import mxfp4_quantize

    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    near = torch.cat(
        [points, torch.nextafter(points, torch.tensor(9.0)), torch.nextafter(points, torch.tensor(-1.0))]
    )
    values = torch.cat([near, -near]).to(torch.bfloat16).float()  # what a bf16 input can hold
    rows = []
    for i in range(0, values.numel(), 31):  # 31 values and a 6 that pins each block's scale to 1
        chunk = torch.cat([values[i : i + 31], torch.tensor([6.0])])
        rows.append(torch.nn.functional.pad(chunk, (0, 32 - chunk.numel())))
    x = torch.stack(rows).to(torch.bfloat16)
    q, s = mxfp4_quantize(x)
    ours = quant.quantize(x, "mxfp4")
    assert torch.equal(_bits(s), _bits(ours.scale))
    assert torch.equal(_bits(q), _bits(ours.data))


def test_vllms_keys_name_the_formats():
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu

    from arnorm.integrations._vllm_keys import format_of_key

    assert format_of_key(qu.kFp8Dynamic128Sym) == "fp8_per_group"
    assert format_of_key(qu.kFp8Dynamic64Sym) == "fp8_per_group_64"
    assert format_of_key(qu.kMxfp4Dynamic) == "mxfp4"


@pytest.mark.parametrize("key_name", ["kFp8Dynamic128Sym", "kFp8Dynamic64Sym", "kMxfp4Dynamic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_drop_in_matches_vllms_own_chain_at_tp1(key_name, dtype):
    """arnorm's quant entry point against vLLM's GemmaRMSNorm (forward_native) then vLLM's quantizer,
    the chain a block-FP8 (or MX) model runs: codes and row-major scales bit for bit, and vLLM's own
    QuantizedActivation back."""
    from vllm.model_executor.layers.fusion.quant_activation import QuantizedActivation
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import mxfp4_quantize

    import arnorm
    from arnorm.integrations import vllm as av

    hidden, eps = 512, 1e-6
    g = torch.Generator().manual_seed(3)
    x, residual = ((torch.randn(7, hidden, generator=g) * 2).to(dtype) for _ in range(2))
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        norm = GemmaRMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_((torch.randn(hidden, generator=g) * 0.2).to(dtype))
    want_y, want_h = norm.forward_native(x.clone(), residual.clone())
    if key_name == "kMxfp4Dynamic":
        want_q, want_s = mxfp4_quantize(want_y)
    else:
        group = 128 if key_name == "kFp8Dynamic128Sym" else 64
        want_q, want_s = per_token_group_quant_fp8(want_y, group, use_ue8m0=False)
    av.configure(group=arnorm.LOCAL, max_tokens=16)
    key = getattr(qu, key_name)
    got = av.fused_allreduce_gemma_rms_norm_quant(x.clone(), residual.clone(), norm.weight, eps, None, key)
    assert got is not None
    q, normed, new_residual = got
    assert isinstance(q, QuantizedActivation) and q.quant_key is key
    assert torch.equal(_bits(new_residual), _bits(want_h)) and torch.equal(_bits(normed), _bits(want_y))
    assert torch.equal(_bits(q.data), _bits(want_q)) and torch.equal(_bits(q.scale), _bits(want_s))


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def chain_report(request):
    import json

    import vllm_lane_group_ranks as ranks

    from arnorm.testing import run_ranks

    world = request.param
    results = run_ranks(world, ranks.group_chain, timeout=1500, env={"VLLM_TARGET_DEVICE": "cpu"})
    text = json.dumps(results, indent=1, default=str)
    print(f"\n=== group formats vs vLLM's chain, TP {world} ===\n{text}")
    return world, results


@pytest.mark.slow
def test_drop_in_matches_vllms_whole_chain_at_tp1_and_tp2(chain_report):
    """At TP 1 and 2 (vLLM's parallel state over gloo): arnorm's quant entry point against vLLM's
    tensor_model_parallel_all_reduce, its GemmaRMSNorm, then its per_token_group_quant_fp8 or
    mxfp4_quantize. Codes, scales, normed and residual bit for bit on every rank, vLLM's
    QuantizedActivation back; above the budget, None (the caller's path)."""
    world, results = chain_report
    import vllm_lane_group_ranks as ranks

    for rank, report in enumerate(results):
        assert report["world"] == world
        for row in report["rows"]:
            within = row["tokens"] <= max(ranks.TOKENS) - 1
            assert row["returned"] is within, (rank, row)
            if not within:
                continue
            assert list(row["served"].values()) == [{"triton": 1}], (rank, row)  # arnorm's fused kernel
            flags = ("type_is_vllms", "residual_bitwise", "normed_bitwise", "codes_bitwise", "scales_bitwise",
                     "codes_vs_vllm_quant_of_normed", "scales_vs_vllm_quant_of_normed")  # fmt: skip
            assert all(row[f] for f in flags), (rank, row)
