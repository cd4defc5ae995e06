"""The vLLM lane: arnorm's vLLM drop-ins where a new user pushes them, against vLLM 0.33 on CPU.

A probe nothing matches, a reloaded fp32 weight, norm subclasses, ``residual=None``, mixed dtypes
(TP 1, one spawned rank with vLLM's parallel state; arnorm's triton kernel interpreted).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM lane needs vllm (tests/vllm_lane/run.sh)")

from arnorm.testing import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def report():
    import vllm_lane_edges

    (got,) = run_ranks(1, vllm_lane_edges.edges, timeout=900, env={"VLLM_TARGET_DEVICE": "cpu"})
    print(f"\n=== vLLM lane, drop-in edges ===\n{json.dumps(got, indent=1, default=str)}")
    return got


@pytest.mark.parametrize("case", ["wrapped", "subclass", "neutral_plain"])
def test_a_norm_no_arithmetic_matches_runs_vllms_own_path(report, case):
    """Item 5 and 7b: a forward wrapped by a closure over the original module (its copy ignores the
    probe's weight), a GemmaRMSNorm subclass with its own forward, a plain norm of a neutral class
    name handed to the Gemma helper: they used to run fused with the nearest arithmetic (off by
    3.8-5.2); now vLLM's own result, bit for bit, with one warning naming the module."""
    r = report["probe"][case]
    assert r["bitwise_vllm"], r
    assert r["served"] == ["unfused"], r
    (said,) = r["warnings"]
    name = {"wrapped": "GemmaRMSNorm", "subclass": "ScaledGemmaRMSNorm", "neutral_plain": "Norm"}[case]
    assert said.startswith(f"arnorm.integrations.vllm: {name} (torch.bfloat16) runs vLLM's own path"), said
    assert r["warnings_again"] == [], r
    if case == "wrapped":
        assert "does not respond to the weight it is given" in said, said


def test_known_arithmetic_says_what_each_platform_computes_or_refuses(report):
    """Item 5: without a probe, vLLM 0.33's plain RMSNorm on CUDA is its C kernel (sum rounded
    first, rounded before the weight), on CPU the native torch arithmetic; anything arnorm does not
    know is not guessed. ``[round_before_weight, normalize_unrounded]``."""
    assert report["known"] == {
        "plain_cuda": [True, False],
        "plain_fp32_weight_cuda": [False, True],
        "plain_cpu": [True, True],
        "gemma_cuda": [False, True],
        "gemma_cpu": [False, True],
        "subclass_cuda": None,
        "plain_xpu": None,
    }


def test_an_fp32_weight_reloaded_without_a_version_bump_is_read_afresh(report):
    """Item 7a: vLLM's default_weight_loader writes through param.data.copy_ (no version bump); the
    first call's bf16 copy of the weight used to stay in use (max difference 9.16)."""
    r = report["reloaded"]
    assert not r["version_moved"], r  # the case at hand
    assert r["served_first"] == ["triton"] and r["served"] == ["triton"], r
    assert r["bitwise_vllm"] and r["max_diff"] == 0.0, r


@pytest.mark.parametrize("case", ["gemma/1", "gemma/2", "gemma/7", "plain/1", "plain/2", "plain/7"])
def test_residual_none_returns_what_vllm_returns(report, case):
    """Item 7c: ``residual=None`` raised "too many values to unpack" at T 7 and returned a tuple of two
    rows at T 2; vLLM returns the normed ``[T, H]`` tensor."""
    assert report["returns"]["none"][case] is True, report["returns"]["none"][case]


def test_mixed_dtypes_return_vllms_dtypes(report):
    """Item 7d: fp32 x with a bf16 residual returned the residual rounded to bf16 where vLLM returns
    fp32 (and the reverse fp32 where vLLM returns bf16)."""
    for case, r in report["returns"]["mixed"].items():
        assert r["dtypes"] == r["vllm_dtypes"] and r["bitwise_vllm"], (case, r)


def test_arnorm_vllm_0_on_one_tp_rank_is_an_error_on_every_rank():
    """Item 7e: ARNORM_VLLM=0 on rank 0 only used to block both ranks with no error (rank 0 in
    vLLM's all-reduce, rank 1 in arnorm's agreement). Now every rank raises the same error, at once."""
    import vllm_lane_edges

    base = {"VLLM_TARGET_DEVICE": "cpu", "ARNORM_PEER_TIMEOUT": "30"}
    env = [{**base, "ARNORM_VLLM": "0"}, base]
    results = run_ranks(2, vllm_lane_edges.one_rank_disabled, env=env, timeout=600)
    print(f"\n=== vLLM lane, ARNORM_VLLM=0 on rank 0 only ===\n{results}")
    (first, _), (second, _) = results
    assert first == second, results
    assert first[:2] == ("error", "InvalidInputError"), first
    assert first[2].startswith(
        "ARNORM_VLLM: differs across the TP ranks (rank 0: left to vLLM (ARNORM_VLLM=0); "
        "rank 1: routed to arnorm) (needs the same value on every rank"
    ), first
    assert all(took < 20 for _, took in results), results
