"""Workspace budgets, sharing, life cycle, and the setup agreement (no rank half-enters a collective)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from fake_flashinfer import FakeComm, fake_fi_fixture, install, make_problem, reset_workspaces  # noqa: F401  (fixture)

import arnorm
from arnorm._errors import BackendSetupError
from arnorm_flashinfer import _workspace
from arnorm_flashinfer._backend import FlashInferBackend
from arnorm_flashinfer._plugin import FlashInferSettings
from arnorm_flashinfer._preflight import MEMORY_MARGIN, Facts, decide
from arnorm_flashinfer._workspace import MIB, budget_mb, token_capacity

GRAMMAR = re.compile(r"^[^:]+: .+ \(needs .+\)$")


def build(config=None, comm=None, **overrides):
    problem = make_problem(**overrides)
    comm = comm or FakeComm(problem.world_size)
    return FlashInferBackend.create(problem, comm, config or FlashInferSettings())


def setup_error(config=None, comm=None, **overrides) -> str:
    with pytest.raises(BackendSetupError) as err:
        build(config, comm, **overrides)
    return str(err.value)


# -- budgets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "world", "mb", "source"),
    [
        ((9, 0), 2, 64, "table sm90/tp2"),
        ((9, 0), 4, 2, "table sm90/tp4"),
        ((9, 0), 8, 0.5, "table sm90/tp8"),
        ((9, 0), 16, 0.5, "table sm90 minimum (no tp16 entry)"),
        ((10, 0), 4, 32, "table sm100/tp4"),
        ((10, 0), 16, 64, "table sm100/tp16"),
        ((10, 3), 8, 4, "table sm103/tp8"),
        ((10, 1), 8, 1, "table sm100/tp8"),  # nearest lower row of the same major
        ((12, 0), 8, 0.5, "table sm90/tp8"),  # no row of its major: SM90's, the most conservative
    ],
)
def test_budget_table(arch, world, mb, source):
    assert budget_mb(arch, world, None) == (mb, source)


def test_budget_override_and_capacity(fake_fi, clean_env):
    assert budget_mb((9, 0), 8, 3.0) == (3.0, "ARNORM_FLASHINFER_MAX_SIZE_MB")
    assert token_capacity(0.5, 4096, 2, 10_000) == 64
    assert token_capacity(64, 4096, 2, 100) == 100  # never more than the op's max_tokens
    assert token_capacity(1e6, 65536, 4, 10**9) == (2**31 - 1) // 65536  # tokens * hidden fits an int32
    backend = build(
        config=FlashInferSettings(max_size_mb=1.0), hidden_size=4096, max_tokens=10_000, world_size=8
    )
    assert backend.capacity == 128
    assert fake_fi.creates[-1]["max_token_num"] == 128


def test_budget_from_the_environment(fake_fi, clean_env):
    """ARNORM_FLASHINFER_MAX_SIZE_MB reaches create() through the backend's settings model."""
    from arnorm.registry._discovery import get_registry
    from arnorm.registry._load import backend_settings

    clean_env.setenv("ARNORM_FLASHINFER_MAX_SIZE_MB", "0.25")
    settings = backend_settings(get_registry().get("flashinfer").spec, None)
    assert settings == FlashInferSettings(max_size_mb=0.25)
    assert build(hidden_size=4096, max_tokens=10_000, config=settings).capacity == 32


# -- sharing and life cycle --------------------------------------------------------------------


def test_ops_of_one_group_hidden_and_dtype_share_a_workspace(fake_fi, clean_env):
    comm = FakeComm()
    a = build(comm=comm)
    b = build(comm=comm, quant="fp8_static")  # another pattern: same workspace
    c = build(comm=comm, max_tokens=8)  # a smaller budget fits in the cached one
    assert len(fake_fi.creates) == 1
    (ws,) = fake_fi.workspaces
    assert a._workspace is b._workspace is c._workspace is ws
    a.close()
    b.close()
    a.close()  # idempotent: a second close drops nothing
    assert ws.destroy_count == 0
    assert fake_fi.module_refs  # FlashInfer's module-level refs to the buffers
    c.close()
    assert ws.destroy_count == 1
    assert fake_fi.module_refs == {}  # released too, or the memory would stay mapped
    assert _workspace.live_entries() == []
    build(comm=comm).close()  # after the last holder closed, a new one is created
    assert len(fake_fi.creates) == 2 and fake_fi.workspaces[1].destroy_count == 1


def test_distinct_groups_hidden_sizes_dtypes_get_distinct_workspaces(fake_fi, clean_env):
    comm = FakeComm()
    build(comm=comm)
    build(comm=comm, hidden_size=128)
    build(comm=comm, dtype="float16")
    build(comm=FakeComm(name="other-tp"))
    build(comm=comm, max_tokens=128)  # needs more than the cached capacity
    assert len(fake_fi.creates) == 5


def test_reuse_needs_every_rank_to_hold_the_same_workspace(fake_fi, clean_env):
    build(comm=FakeComm())
    # The peer reports no cached workspace: every rank creates a fresh one (no rank skips the collective).
    build(comm=FakeComm(peer=lambda f, r: dataclasses.replace(f, cached={})))
    assert len(fake_fi.creates) == 2


def test_exit_teardown_is_local_and_never_raises(fake_fi, clean_env):
    comm = FakeComm()
    build(comm=comm)
    build(comm=comm, hidden_size=128)
    gathers = len(comm.gathers)
    fake_fi.workspaces[0].destroy = lambda: (_ for _ in ()).throw(RuntimeError("driver gone"))
    _workspace._destroy_all_at_exit()
    assert _workspace.live_entries() == []
    assert fake_fi.workspaces[1].destroy_count == 1
    assert len(comm.gathers) == gathers  # no collective at exit
    assert _workspace._atexit_registered


def test_a_failed_setup_releases_nothing_it_did_not_take(fake_fi, clean_env):
    fake_fi.fail_create = "cuMemMap failed"
    with pytest.raises(RuntimeError, match="cuMemMap"):
        build()
    assert _workspace.live_entries() == [] and _workspace._cache == {}


# -- agreement -------------------------------------------------------------------------------


def test_local_jit_failure_raises_before_any_collective(fake_fi, clean_env):
    fake_fi.fail_build = "nvcc not found"
    msg = setup_error()
    assert msg.startswith("setup: RuntimeError: nvcc not found (needs FlashInfer's JIT build to succeed)")
    assert fake_fi.creates == []


def test_a_peer_failure_raises_the_same_error_here(fake_fi, clean_env):
    comm = FakeComm(
        peer=lambda f, r: dataclasses.replace(f, error="setup: RuntimeError: nvcc not found (needs x)")
    )
    assert setup_error(comm=comm) == "rank 1: setup: RuntimeError: nvcc not found (needs x)"
    assert fake_fi.creates == []


def test_ranks_on_two_hosts_are_refused_for_trtllm(fake_fi, clean_env):
    comm = FakeComm(peer=lambda f, r: dataclasses.replace(f, host="elsewhere"))
    msg = setup_error(comm=comm)
    assert msg.startswith("hosts: 2 (needs every rank on one host") and GRAMMAR.match(msg)
    assert fake_fi.creates == []


def test_group_size_and_budget_problems_are_agreed_too(fake_fi, clean_env):
    msg = setup_error(comm=FakeComm(4), world_size=2)
    assert "world size: 4 ranks in the group (needs 2)" in msg
    msg = setup_error(config=FlashInferSettings(max_size_mb=1e-6))
    assert msg.startswith("workspace budget: 1e-06 MiB (ARNORM_FLASHINFER_MAX_SIZE_MB) (needs >= 128 bytes")
    assert fake_fi.creates == []


def facts(**kw) -> Facts:
    base = {"host": "h", "gpu": None, "error": None, "tokens": 64, "budget": 64.0, "budget_source": "t"}
    base.update(kw)
    return Facts(**base)


def test_decide_is_pure_and_takes_the_smallest_budget():
    problem = make_problem()
    gathered = [facts(gpu="a", tokens=64), facts(gpu="b", tokens=32, budget=1.0, budget_source="env")]
    plans = {decide(gathered, problem, False) for _ in range(3)}
    (plan,) = plans
    assert plan.error is None and plan.tokens == 32 and plan.budget == 1.0 and plan.budget_source == "env"
    assert plan.kind == "trtllm" and not plan.reuse and plan.gpus_per_node == 2


def test_decide_refuses_shared_gpus_missing_peer_access_and_short_memory():
    problem = make_problem(hidden_size=4096)
    shared = decide([facts(gpu="g0"), facts(gpu="g0")], problem, False)
    assert shared.error == "devices: ranks 0 and 1 share GPU g0 (needs one GPU per rank)"
    # ARNORM_FLASHINFER_SHARED_GPU (testing on one GPU) lets them through.
    assert decide([facts(gpu="g0"), facts(gpu="g0")], problem, False, shared_gpu=True).error is None
    no_p2p = decide(
        [facts(gpu="g0", peers={"g1": False}), facts(gpu="g1", peers={"g0": True})], problem, False
    )
    assert no_p2p.error.startswith("peer access: none between ranks 0->1 (needs P2P")
    unknown = decide([facts(gpu="g0"), facts(gpu="g1", peers={"other": False})], problem, False)
    assert unknown.error is None  # unknown peers: FlashInfer's own setup decides
    need = _workspace.workspace_bytes("trtllm", 64, 4096, 2, 2) + MEMORY_MARGIN
    short = decide([facts(gpu="g0", free_bytes=need - 1), facts(gpu="g1", free_bytes=need)], problem, False)
    assert short.error.startswith(
        f"device memory: {(need - 1) / MIB:.0f} MiB free on rank 0 (needs {need / MIB:.0f}"
    )
    state = (1, "trtllm", 64)
    reuse = decide([facts(free_bytes=0, cached={"trtllm": state})] * 2, problem, False)
    assert reuse.error is None and reuse.reuse  # reusing allocates nothing: no memory check


def test_workspace_bytes_matches_flashinfer_sizing():
    # buffer tp*T*H*2 + flags tp*256*4 + 3 Lamport buffers of tp*T*H*elem
    assert _workspace.workspace_bytes("trtllm", 100, 4096, 2, 8) == 8 * 100 * 4096 * 2 * 4 + 8 * 1024
    assert _workspace.workspace_bytes("trtllm", 10**6, 8192, 2, 8) == (
        8 * 10**6 * 8192 * 2 + 8 * 1024 + 3 * _workspace.MAX_COMM_SIZE
    )


# -- MNNVL opt-in ------------------------------------------------------------------------------


def test_mnnvl_only_when_enabled_and_every_rank_has_multicast(monkeypatch, clean_env):
    reset_workspaces()
    state = install(monkeypatch, multicast=True)
    backend = build(config=FlashInferSettings(mnnvl=True))
    (kw,) = state.creates
    assert kw["backend"] == "mnnvl" and kw["gpus_per_node"] == 2
    # Both modules are built up front: a fallback to trtllm must not build inside the collective.
    assert state.builds == ["trtllm", "mnnvl"]
    assert backend.kind == "mnnvl" and backend._oneshot_for(8) is None  # MNNVL's AUTO strategy
    no_multicast = FakeComm(peer=lambda f, r: dataclasses.replace(f, multicast=False))
    kinds = [
        build(config=FlashInferSettings()).kind,  # not enabled
        build(config=FlashInferSettings(mnnvl=True), comm=no_multicast).kind,  # not on every rank
        build(config=FlashInferSettings(mnnvl=True), quant="mxfp8").kind,  # MXFP8 is TRT-LLM only
        build(config=FlashInferSettings(mnnvl=True), quant="fp8_per_token").kind,  # MNNVL: unrounded amax
    ]
    assert kinds == ["trtllm"] * 4
    assert [c["backend"] for c in state.creates] == ["mnnvl", "trtllm"]  # the trtllm ops share one
    reset_workspaces()


def test_mnnvl_keeps_fp16_off_before_the_fp16_square_fix(monkeypatch, clean_env):
    reset_workspaces()
    state = install(monkeypatch, multicast=True, version="0.7.2")
    build(config=FlashInferSettings(mnnvl=True), dtype="float16")
    build(config=FlashInferSettings(mnnvl=True), dtype="bfloat16")
    assert [c["backend"] for c in state.creates] == ["trtllm", "mnnvl"]
    reset_workspaces()


def test_never_auto(fake_fi, clean_env):
    for quant in (None, "fp8_static", "fp8_per_token", "mxfp8"):
        build(quant=quant, hidden_size=128).close()
    assert {c["backend"] for c in fake_fi.creates} == {"trtllm"}
    assert all(c["dtype"] is torch.bfloat16 for c in fake_fi.creates)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "lots"])
def test_a_bad_budget_variable_is_a_config_error_naming_it(value, monkeypatch):
    """ARNORM_FLASHINFER_MAX_SIZE_MB must be a positive, finite number; the error names the variable."""
    from arnorm.registry._discovery import get_registry
    from arnorm.registry._load import backend_settings

    monkeypatch.setenv("ARNORM_FLASHINFER_MAX_SIZE_MB", value)
    with pytest.raises(arnorm.ConfigError, match="ARNORM_FLASHINFER_MAX_SIZE_MB"):
        backend_settings(get_registry().get("flashinfer").spec, None)
