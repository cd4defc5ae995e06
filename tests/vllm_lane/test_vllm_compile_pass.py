"""arnorm's compile pass inside vLLM's own pass manager (vLLM 0.33.0, CPU, TP 2 over gloo).

vLLM's CPU engine compiles with plain Inductor and never runs vLLM's passes, so the proof drives
vLLM's ``VllmBackend.configure_post_pass`` and ``PostGradPassManager`` directly, on modules built
from vLLM's seam code (vllm_lane_pass_ranks.py): every seam matched, none left before a norm,
arnorm's fused backend serving on both ranks, outputs bitwise equal to the same module run eagerly
by vLLM without arnorm, and a fresh process that hits Inductor's cache still calling arnorm. The
config test runs vLLM's front end with and without arnorm's plugin. Reports go into the log.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM lane needs vllm (tests/vllm_lane/run.sh)")

from arnorm.testing import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: Per dtype: 2 kinds x 3 eps x (with, without residual) x 2 layers, one with the static FP8 tail,
#: one with a per-token-group FP8 tail (UE8M0, column-major TMA-aligned scales).
SEAMS = 24
#: vLLM's CPU kernels stay unloaded in these ranks: loaded, vLLM's CPU communicator would take its
#: shared-memory all-reduce instead of gloo (vllm_lane_pass_ranks.cuda_op_stand_ins has what the
#: pass manager names).
NO_CPU_KERNELS = {"LANE_VLLM_CPU_KERNELS": ""}


def _show(name: str, results: list) -> None:
    print(f"\n=== vLLM compile pass, {name} ===\n{json.dumps(results, indent=1, default=str)}")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("inductor-cache"))


@pytest.fixture(scope="module")
def first(cache_dir):
    import vllm_lane_pass_ranks as ranks

    env = {"VLLM_TARGET_DEVICE": "cpu", "TORCHINDUCTOR_CACHE_DIR": cache_dir, **NO_CPU_KERNELS}
    results = run_ranks(2, ranks.compile_pass, "first", timeout=2400, env=env)
    _show("first compile (the pass runs)", results)
    return results


@pytest.fixture(scope="module")
def cached(first, cache_dir):
    import vllm_lane_pass_ranks as ranks

    env = {"VLLM_TARGET_DEVICE": "cpu", "TORCHINDUCTOR_CACHE_DIR": cache_dir, **NO_CPU_KERNELS}
    results = run_ranks(2, ranks.compile_pass, "cached", timeout=2400, env=env)
    _show("second process (Inductor's cache)", results)
    return results


def test_the_pass_runs_in_vllms_pass_manager_after_vllms_own(first):
    for r in first:
        assert r["passes"][-1] == "ArnormFusionPass", r["passes"]
        assert r["uuid"] == first[0]["uuid"]  # the same cache key on every rank


def test_every_seam_is_matched_and_none_is_left_before_a_norm(first):
    import vllm_lane_pass_ranks as ranks

    for r in first:
        for dtype, row in r["dtypes"].items():
            (graph,) = row["graphs"]
            assert graph["unexpected"] is None and graph["left"] == [], (dtype, graph)
            assert len(graph["fused"]) == SEAMS and graph["remaining"] == 0, (dtype, graph)
            kinds = set(graph["fused"])
            assert kinds == {"rms_norm", "add_rms_norm", "gemma_rms_norm", "gemma_add_rms_norm",
                             "add_rms_norm+fp8_static", ranks.GROUP_TAIL_KIND}, kinds  # fmt: skip


def test_a_fused_backend_serves_on_both_ranks_bitwise_equal_to_eager_vllm(first):
    for r in first:
        for dtype, row in r["dtypes"].items():
            assert row["served"] == {"vllm_compile_pass": {"triton": SEAMS}}, (
                r["rank"],
                dtype,
                row["served"],
            )
            assert row["bitwise"] and all(row["bitwise"]), (r["rank"], dtype, row["bitwise"])


def test_a_second_process_hitting_inductors_cache_still_calls_arnorm(cached):
    for r in cached:
        for dtype, row in r["dtypes"].items():
            assert row["graphs"] == [], (dtype, row["graphs"])  # no pass ran: the cached graph did
            assert row["fxgraph_cache_hit"] > 0, row
            assert row["served"] == {"vllm_compile_pass": {"triton": SEAMS}}, (
                r["rank"],
                dtype,
                row["served"],
            )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from arnorm_vllm_lane.engine import checkpoint as make

    return make(str(tmp_path_factory.mktemp("lane-models")), "plain", "bfloat16", None)


def _config(path: str, plugins: str, **env: str) -> dict:
    import vllm_lane_pass_ranks as ranks

    environ = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": plugins, **env}
    (result,) = run_ranks(1, ranks.engine_config, path, timeout=900, env=environ)
    return result


def test_create_engine_config_with_the_plugin_carries_the_pass(checkpoint):
    without = _config(checkpoint, "arnorm_lane")
    with_pass = _config(checkpoint, "arnorm_lane,arnorm")
    again = _config(checkpoint, "arnorm_lane,arnorm")
    take = _config(checkpoint, "arnorm_lane,arnorm", ARNORM_VLLM_PASS="take")
    _show("engine configs (without, with, again, take)", [without, with_pass, again, take])
    assert without["slot"] is None
    assert with_pass["slot"]["type"] == "ArnormFusionPass" and "policy='after'" in with_pass["slot"]["repr"]
    assert with_pass["hash"] != without["hash"]
    assert with_pass["hash"] == again["hash"] == with_pass["unpickled_hash"]  # every process alike
    assert with_pass["unpickled_slot"] == with_pass["slot"]  # pickled to a worker, the same pass
    assert take["slot"]["uuid"] != with_pass["slot"]["uuid"] and take["fuse_allreduce_rms"] is False
