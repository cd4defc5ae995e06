"""The vLLM lane: arnorm's vLLM drop-ins against an installed vLLM 0.33 on CPU (tests/vllm_lane/run.sh).

Skipped where vllm is not importable, so the main CI is unchanged. vLLM's own parallel state at TP 1
and TP 2 over gloo, its GemmaRMSNorm and RMSNorm, its fused_allreduce_gemma_rms_norm and
fused_allreduce_rms_norm (the seeds, unfused on CPU), its QuantKeys, QuantizedActivation and
PerTensorTorchFP8ScaledMMLinearKernel; arnorm's triton kernel serves the fused path (interpreted).
Each TP size runs once (importing vLLM takes a while); the tests assert on its report, which is
printed into the lane's log.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM lane needs vllm (tests/vllm_lane/run.sh)")

from arnorm.testing import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def report(request):
    import vllm_lane_ranks

    world = request.param
    results = run_ranks(world, vllm_lane_ranks.lane, timeout=1500, env={"VLLM_TARGET_DEVICE": "cpu"})
    print(f"\n=== vLLM lane report, TP {world} (rank 0) ===\n{json.dumps(results[0], indent=1, default=str)}")
    for rank, other in enumerate(results[1:], 1):
        assert other["norms"] == results[0]["norms"], f"rank {rank} differs from rank 0"
    return world, results[0]


def test_vllm_parallel_state_is_used(report):
    world, r = report
    assert r["state"] == {"tp_world_size": world, "uses_vllm_groups": True}


def test_vllm_quant_keys_map_by_their_fields(report):
    _, r = report
    assert r["keys"] == {
        "kFp8StaticTensorSym": "fp8_static",
        "kFp8DynamicTokenSym": "fp8_per_token",
        "kNvfp4Dynamic": "nvfp4",
        "kMxfp8Dynamic": "mxfp8",
        "kFp8DynamicTensorSym": None,
        "kFp8StaticTokenSym": None,
        "kFp8Dynamic128Sym": "fp8_per_group",
        "kNvfp4DynamicToken": None,
        "kNvfp4Static": None,
        "kMxfp8Static": None,
    }


def test_norm_drop_ins_match_vllms_own_helpers(report):
    """Residual and normed bitwise, fused or not, bf16 and fp16, fp16 and fp32 module weights (the
    interpreted kernel sums the squares in torch's CPU order: arnorm_triton/_sum_order.py); the
    rounded-sum arithmetic (arnorm before issue 35) differs on many values."""
    _, r = report
    for row in r["norms"]["rows"]:
        assert row["residual_bitwise"], row
        n = row["normed"]
        assert n["differ"] == 0, row
        if row["backend"] == "triton":
            assert "unrounded" in row["problem"], row
        if row["kind"] == "gemma":
            assert row["rounded_sum_arithmetic"]["differ"] > 10, row
    backends = {row["backend"] for row in r["norms"]["rows"]}
    assert backends == {"triton", "unfused (over budget)"}, backends
    for row in r["norms"]["rows"]:  # the call itself went where op_for says (arnorm's tally)
        assert row["served"] == {"triton" if row["backend"] == "triton" else "unfused": 1}, row
    # Issue 44: fp16 activations with fp32 module weights run fused too (the weights hold fp16 values).
    fp32_weights = [row for row in r["norms"]["rows"] if row["weights"] == "float32"]
    assert {row["kind"] for row in fp32_weights} == {"gemma", "plain"}
    assert {row["backend"] for row in fp32_weights} == {"triton", "unfused (over budget)"}


def test_quant_entry_returns_vllms_quantized_activation(report):
    _, r = report
    q = r["quant"]
    assert q["fp8_type"] == "vllm.model_executor.layers.fusion.quant_activation.QuantizedActivation"
    assert q["fp8_fields"]["quant_key_is_callers"] and q["fp8_fields"]["scale_is_callers"]
    assert q["fp8_fields"]["orig_dtype"] == "torch.bfloat16" and q["fp8_fields"]["orig_shape"] == [8, 2048]
    # What the entry point returned before issue 35: vLLM's kernel asserts it got a tensor.
    assert str(q["arnorm_type_refused"]).startswith("AssertionError")
    assert all(q["nvfp4"][k] for k in ("type_is_vllms", "quant_key_is_callers",
                                       "scale_shape_dtype_as_scaled_fp4_quant"))  # fmt: skip
    assert (
        q["mxfp8_quant_entry"]["type_is_vllms"]
        and q["mxfp8_quant_entry"]["scale_shape_dtype_as_vllm_swizzled"]
    )


def test_real_fp8_linear_kernel_takes_it_bitwise(report):
    """vLLM's PerTensorTorchFP8ScaledMMLinearKernel: arnorm's QuantizedActivation gives the GEMM output
    of vLLM's own static quantization of arnorm's normed output, bit for bit."""
    _, r = report
    assert r["quant"]["gemm_bitwise_vs_vllm_quant_of_arnorm_normed"] is True


def test_mxfp8_returns_wherever_arnorm_computes(report):
    """Issue 44: the seed's call returns row-major E8M0 scales [T, H // 32]; swizzled only on request."""
    _, r = report
    hidden = r["mxfp8"]["hidden"]
    for row in r["mxfp8"]["rows"]:
        assert row["returned"] and row["codes_are_arnorm_quant"], row
        assert row["seed_call_scale_shape"] == [row["tokens"], hidden // 32], row
        assert row["seed_call_scale_dtype"] == "torch.uint8" and row["seed_call_scales_row_major"], row
        assert row["seed_call_normed_is_none"] and row["swizzled_scale_shape_as_vllm"], row
