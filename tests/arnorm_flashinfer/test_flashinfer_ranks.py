"""The flashinfer backend across real processes: gloo on CPU with the fake, and the real kernel on 2+ GPUs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fake_flashinfer import fake_fi_fixture, make_problem  # noqa: F401  (fixture)
from flashinfer_rank_fns import CPU_CASES, cpu_suite, use_registry

import arnorm
from arnorm.testing import run_ranks

# -- CPU: two gloo ranks, the fake flashinfer in each --------------------------------------------


@pytest.fixture(scope="module")
def cpu_ranks():
    """One spawn of two gloo ranks runs every CPU multi-rank scenario (see ``cpu_suite``)."""
    return run_ranks(2, cpu_suite, timeout=300)


@pytest.mark.slow
def test_a_failure_on_one_rank_raises_everywhere_without_a_hang(cpu_ranks):
    results = [r["failure"] for r in cpu_ranks]
    (msg,) = {msg for msg, _ in results}
    assert msg.startswith("rank 1: setup: RuntimeError: nvcc not found (needs FlashInfer's JIT build")
    assert [creates for _, creates in results] == [[], []]  # nobody entered FlashInfer's collective


@pytest.mark.slow
@pytest.mark.parametrize(("quant", "layout"), CPU_CASES)
def test_selected_through_arnorm_with_reasons_and_fallback(cpu_ranks, quant, layout):
    for rank, ranks in enumerate(cpu_ranks):
        r = ranks[f"{quant}/{layout}"]
        assert r["backend"] == "flashinfer"
        assert r["backend_for"] == ("flashinfer", "reference")
        assert r["checks"] == [(1, True), (5, True), (8, True), (12, True)]
        assert r["create"] == {"backend": "trtllm", "world_size": 2, "rank": rank, "max_token_num": 8}
        assert r["group_is_world"]
        assert r["fused_calls"] == 3  # 1, 5, 8 tokens; 12 went to the reference
        assert r["destroyed"] == [1]
        lines = r["explain"].splitlines()
        assert any(line.startswith("flashinfer") and "selected" in line for line in lines)
        assert any(line.startswith("reference") and "fallback" in line for line in lines)
        assert "tokens=12: reference" in r["explain12"]
        assert "flashinfer skipped: tokens: 12 (needs <= 8: the workspace holds" in r["explain12"]


# -- CPU, one process: the rejection at TP 1 through selection -----------------------------------


def _pretend_sm90(monkeypatch) -> None:
    import arnorm.op._args

    monkeypatch.setattr(arnorm.op._args, "platform_of", lambda device: ("cuda", (9, 0), None))


def test_tp1_is_rejected_with_its_reason(fake_fi, clean_env):
    use_registry()
    _pretend_sm90(clean_env)
    kw = {"hidden_size": 64, "dtype": torch.bfloat16, "norm": arnorm.RMSNorm(1e-6), "device": "cpu"}
    with arnorm.AllReduceNorm(arnorm.LOCAL, **kw) as op:
        assert op.backend == "reference"
        assert op.explain().rejections()["flashinfer"] == ("world size: 1 (needs 2, 4, 8 or 16)",)
    with pytest.raises(arnorm.NoEligibleBackendError, match=r"world size: 1 \(needs") as info:
        arnorm.AllReduceNorm(arnorm.LOCAL, backend="flashinfer", **kw)
    assert info.value.explanation.verdict("flashinfer").status == "incompatible"
    assert fake_fi.builds == [] and fake_fi.creates == []


def test_nvfp4_on_sm90_through_selection(fake_fi, clean_env):
    use_registry()
    problem = make_problem(quant="nvfp4")
    from arnorm.registry._select import Preference, check_locally

    verdicts = check_locally(problem, arnorm.registry._discovery.get_registry(), Preference(None, "auto"))
    verdict = verdicts["flashinfer"]
    assert verdict.status == "incompatible"
    assert verdict.reasons == ("compute capability: 9.0 (needs >= 10.0 for nvfp4)",)


# -- GPU: the real FlashInfer ------------------------------------------------------------------


def test_the_gpu_comparisons_measure_what_they_claim():
    from flashinfer_rank_fns import _code_distance, _ulps

    a = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, 0.0, 1.0078125, -1.0078125, 3.0], dtype=torch.bfloat16)  # 1 + 2**-7: next bf16
    assert _ulps(a, b).tolist() == [0, 0, 1, 1, 0]
    tiny = torch.tensor([torch.finfo(torch.float32).tiny], dtype=torch.float32)
    assert _ulps(tiny, -tiny).item() == 2 * tiny.view(torch.int32).item()
    fp8 = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float8_e4m3fn)
    fp8b = torch.tensor([1.125, -1.125, -0.0], dtype=torch.float8_e4m3fn)  # the next e4m3 codes
    assert _code_distance(fp8, fp8b, "fp8_static").tolist() == [1, 1, 0]
    packed = torch.tensor([0x21, 0x9A], dtype=torch.uint8)  # nibbles (1, 2) and (-2, -1)
    other = torch.tensor([0x21, 0x9B], dtype=torch.uint8)  # (1, 2) and (-3, -1)
    assert _code_distance(packed, other, "nvfp4").tolist() == [[0, 1], [0, 0]]


def _gpu_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False, "needs two or more CUDA GPUs"
    if importlib.util.find_spec("flashinfer") is None:
        return False, "needs flashinfer-python"
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10, 12):
        return False, f"needs SM9x/10x/12x (found SM{major}x)"
    return True, ""


def _world() -> int:
    return 4 if torch.cuda.device_count() >= 4 else 2


gpu = pytest.mark.skipif(not _gpu_ready()[0], reason=_gpu_ready()[1])


def _quant_cases():
    cases = [("bfloat16", None, None), ("float16", "fp8_static", None), ("bfloat16", "fp8_per_token", None)]
    cases += [
        ("float32", None, None),
        ("bfloat16", "mxfp8", "linear"),
        ("bfloat16", "mxfp8", "swizzled_128x4"),
        ("float32", "mxfp8", "linear"),
    ]
    cases += [("bfloat16", "nvfp4", "swizzled_128x4"), ("bfloat16", "nvfp4", "linear")]
    return cases


@pytest.mark.multigpu
@gpu
@pytest.mark.parametrize(("dtype", "quant", "layout"), _quant_cases())
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_conformance_on_gpus(dtype, quant, layout, offset):
    from flashinfer_rank_fns import gpu_conformance

    if quant == "nvfp4" and torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("nvfp4 needs SM100+ (rejected below, see test_nvfp4_on_sm90_through_selection)")
    if quant == "mxfp8":
        import flashinfer.comm as fc

        if not hasattr(fc.AllReduceFusionPattern, "kARResidualRMSNormMXFP8Quant"):
            pytest.skip("this FlashInfer has no MXFP8 fusion patterns")
    results = run_ranks(_world(), gpu_conformance, dtype, quant, layout, offset, backend="nccl", timeout=900)
    variants = {row["oneshot"] for row in results[0]["stats"]}
    assert variants == {True, False}, results[0]["stats"]  # both kernels exercised
    for r in results:
        for row in r["stats"]:
            assert row["residual_equal"], row
            assert row["normed_max_ulp"] <= 1, row
            if quant is not None:
                assert row["code_max_distance"] <= 1, row
                assert row["code_mismatch_fraction"] <= 1e-3, row
    # Every rank computed the same thing (same sum, same kernel variant).
    assert all(r["stats"] == results[0]["stats"] for r in results)


@pytest.mark.multigpu
@gpu
def test_cuda_graph_capture_on_gpus():
    from flashinfer_rank_fns import gpu_graph_capture

    assert run_ranks(_world(), gpu_graph_capture, backend="nccl", timeout=900) == [True] * _world()


@pytest.mark.multigpu
@gpu
def test_create_and_destroy_repeatedly_on_gpus():
    from flashinfer_rank_fns import gpu_create_destroy

    results = run_ranks(_world(), gpu_create_destroy, 5, backend="nccl", timeout=900)
    assert results == [[0] * 5] * _world()
