"""triton_symm as arnorm sees it, without a GPU: registration and order, settings, static and probe
reasons, the workspace budget, topology checks, and how a call picks its kernel variant."""

from __future__ import annotations

import importlib.util
import itertools
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_cases import make_problem

import arnorm
from arnorm.plugin import BackendSetupError, Comm, check_capabilities
from arnorm_triton.symm import _backend as B
from arnorm_triton.symm._backend import TritonSymmBackend
from arnorm_triton.symm._plugin import (
    CAPABILITIES,
    DEFAULT_MAX_BYTES,
    TritonSymmSettings,
    arnorm_backends,
    auto_oneshot_tokens,
)
from arnorm_triton.symm._setup import agree_topology, collective_step, symmetric_memory_reasons
from arnorm_triton.symm._workspace import ALIGN, emulated, min_bytes, plan_layout

H = 256


def test_registered_between_aiter_and_triton():
    """triton_symm registers through its own entry point at priority 150, so auto mode tries it after
    flashinfer (300) and aiter (200) and before triton (100) and the reference (0)."""
    (spec,) = arnorm_backends()
    assert (spec.name, spec.priority, spec.extra, spec.settings) == (
        "triton_symm", 150, "triton", TritonSymmSettings,
    )  # fmt: skip
    assert spec.load() is TritonSymmBackend
    infos = {b.name: b for b in arnorm.backends()}
    assert infos["triton_symm"].is_available and infos["triton_symm"].priority == 150
    ordered = [b.name for b in sorted(infos.values(), key=lambda b: -(b.priority or 0))]
    known = [n for n in ordered if n in ("flashinfer", "aiter", "triton_symm", "triton", "reference")]
    assert known == ["flashinfer", "aiter", "triton_symm", "triton", "reference"]


def test_residual_free_ops_get_a_zero_residual():
    """The symmetric kernels always read a residual (an add_residual=False conformance case raised
    AttributeError on the H200 when the declaration was inherited from triton's), so triton_symm
    does not declare residual_free and the op wraps it in ZeroResidual's -0.0 rows."""
    from arnorm.op._results import ZeroResidual, with_zero_residual

    assert CAPABILITIES.residual_free is False
    seen = []

    def symm(x, residual, weight, scale):
        seen.append(residual)
        return x.stride(0) + residual.stride(0)

    problem = types.SimpleNamespace(hidden_size=H, dtype="bfloat16")
    (wrapped,) = with_zero_residual([symm], [CAPABILITIES.residual_free], [-1, 0, 0, 0, 0], problem, "cpu")
    assert isinstance(wrapped, ZeroResidual)
    wrapped(torch.ones(3, H, dtype=torch.bfloat16), None, None, None)
    assert seen[0].shape == (3, H) and bool((seen[0] == 0).all()) and bool(seen[0].signbit().all())


def test_settings_defaults_and_variables(clean_env):
    """ARNORM_TRITON_SYMM_MAX_BYTES / _ONESHOT_MAX_TOKENS / _SPIN_LIMIT are read (the crossovers
    unset by default: create() resolves them by world size); bad values name the variable."""
    from arnorm.registry._discovery import get_registry
    from arnorm.registry._load import backend_settings

    spec = get_registry().get("triton_symm").spec
    s = backend_settings(spec, None)
    assert (s.max_bytes, s.oneshot_max_tokens, s.push_max_tokens) == (DEFAULT_MAX_BYTES, None, None)
    clean_env.setenv("ARNORM_TRITON_SYMM_MAX_BYTES", "4096")
    clean_env.setenv("ARNORM_TRITON_SYMM_ONESHOT_MAX_TOKENS", "0")
    clean_env.setenv("ARNORM_TRITON_SYMM_SPIN_LIMIT", "0")
    s = backend_settings(spec, None)
    assert (s.max_bytes, s.oneshot_max_tokens, s.spin_limit) == (4096, 0, 0)
    clean_env.setenv("ARNORM_TRITON_SYMM_MAX_BYTES", "0")
    with pytest.raises(arnorm.ConfigError, match="ARNORM_TRITON_SYMM_MAX_BYTES"):
        backend_settings(spec, None)


def test_static_reasons():
    """CPU and world size 1 (or 16) are declared, so they are rejected before anything is imported."""
    cpu = make_problem(H, torch.bfloat16, world_size=2, device="cpu")
    assert check_capabilities(CAPABILITIES, cpu) == ("platform: cpu (needs cuda or rocm)",)
    gpu1 = make_problem(H, torch.bfloat16, world_size=1, device="meta")
    gpu1 = type(gpu1)(**{**{f: getattr(gpu1, f) for f in gpu1.__dataclass_fields__}, "platform": "cuda",
                         "arch": (9, 0)})  # fmt: skip
    assert check_capabilities(CAPABILITIES, gpu1) == ("world size: 1 (needs 2, 3, 4, 5, 6, 7 or 8)",)
    gpu16 = type(gpu1)(**{**{f: getattr(gpu1, f) for f in gpu1.__dataclass_fields__}, "world_size": 16})
    assert check_capabilities(CAPABILITIES, gpu16) == ("world size: 16 (needs 2, 3, 4, 5, 6, 7 or 8)",)
    # Everything else triton serves, triton_symm serves too, but the TMA-padded scale layouts.
    from arnorm_triton._plugin import CAPABILITIES as TRITON

    for field in ("dtypes", "quant", "norm_options", "strided_rows", "max_hidden"):
        assert getattr(CAPABILITIES, field) == getattr(TRITON, field)
    assert TRITON.scale_layouts - CAPABILITIES.scale_layouts == {"column_major_tma", "packed_ue8m0"}


def test_tma_layouts_are_declined_in_the_reason_grammar():
    """The two TMA-padded layouts are declined with a reason, so triton_symm never serves a call
    asking for them (the next eligible backend does)."""
    problem = make_problem(H, torch.bfloat16, "fp8_per_group_64", "column_major_tma", world_size=2,
                           device="meta")  # fmt: skip
    problem = type(problem)(**{**{f: getattr(problem, f) for f in problem.__dataclass_fields__},
                               "platform": "cuda", "arch": (9, 0)})  # fmt: skip
    (reason,) = check_capabilities(CAPABILITIES, problem)
    assert reason.startswith("scale layout: column_major_tma (needs ")
    assert "packed_ue8m0" not in reason and "column_major" in reason


def test_probe_reasons_without_symmetric_memory(monkeypatch):
    """A torch without symmetric memory, or without distributed, is named in the reason grammar."""
    assert symmetric_memory_reasons() == []
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch.distributed._symmetric_memory" else real(name, *a),
    )
    (reason,) = symmetric_memory_reasons()
    assert reason.startswith("torch symmetric memory: missing in torch ")
    assert "(needs torch.distributed._symmetric_memory" in reason
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    (reason,) = symmetric_memory_reasons()
    assert reason.startswith("torch.distributed: not built into torch")
    gpu = make_problem(H, torch.bfloat16, world_size=2)
    assert reason in TritonSymmBackend.probe(gpu)


def test_explain_names_why_not_on_cpu(clean_env):
    """On CPU, explain() lists triton_symm with its platform reason, between aiter and triton."""
    with arnorm.AllReduceNorm(arnorm.LOCAL, hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6),
                              device="cpu") as op:  # fmt: skip
        text = str(op.explain())
        verdicts = {v.backend: v for v in op.explain().verdicts}
    assert "triton_symm" in text
    assert "platform: cpu (needs cuda or rocm)" in verdicts["triton_symm"].reasons
    names = [v.backend for v in op.explain().verdicts]
    assert names.index("triton_symm") < names.index("triton")


# -- the workspace budget ----------------------------------------------------------------------


@pytest.mark.parametrize("push_max", [0, 128])
@pytest.mark.parametrize("max_tokens", [1, 100, 128, 129, 5000])
@pytest.mark.parametrize("budget", [10_000, 1 << 20, 64 << 20])
def test_layout_fits_the_budget(budget, max_tokens, push_max):
    """The planned buffer never exceeds the budget, serves as many tokens as fit (up to
    max_tokens), keeps regions aligned, and has a sums region only when two-shot can run; the push
    region (after the others) never takes the last row a budget holds, nor more rows than one-shot
    serves."""
    kw = {"world": 4, "slots": 132, "hidden": 4096, "itemsize": 2, "oneshot_max": 128, "push_max": push_max}
    lay = plan_layout(max_tokens=max_tokens, max_bytes=budget, **kw)
    assert lay.total_bytes <= budget or lay.capacity == 0
    assert lay.capacity <= max_tokens
    assert lay.in_off % ALIGN == 0 and lay.sum_off % ALIGN == 0 and lay.push_off % ALIGN == 0
    assert lay.two_shot == (lay.capacity > 128)
    assert lay.push_cap <= min(push_max, 128, max_tokens, lay.capacity)
    assert lay.push_bytes >= 2 * 4 * lay.push_cap * lay.row_bytes
    if lay.capacity:
        assert lay.push_off >= (lay.sum_off if lay.two_shot else lay.in_off) + lay.capacity * lay.row_bytes
        assert lay.sum_off >= lay.in_off + lay.capacity * lay.row_bytes or not lay.two_shot
        bigger = plan_layout(max_tokens=max_tokens, max_bytes=budget + lay.row_bytes * 2 + 2 * ALIGN, **kw)
        assert bigger.capacity >= lay.capacity  # monotone in the budget
    one_token = min_bytes(world=4, slots=132, hidden=4096, itemsize=2)
    assert (lay.capacity == 0) == (budget < one_token)
    if budget == 64 << 20 and max_tokens >= 128 and push_max:
        assert lay.push_cap == 128  # the default budget holds the default push slots at H 4096, TP 4


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(2, 8),
    hidden=st.integers(1, 1024).map(lambda k: 16 * k),
    itemsize=st.sampled_from([2, 4]),
    max_tokens=st.integers(1, 5000),
    budget=st.integers(1 << 10, 1 << 27),
    oneshot=st.integers(0, 512),
    push=st.integers(0, 512),
)
def test_layout_regions_never_overlap(world, hidden, itemsize, max_tokens, budget, oneshot, push):
    """For any shape and budget: flags, inputs, sums and push slots are disjoint, 256-byte aligned and
    inside the buffer, the buffer fits the budget whenever a token fits, and push serves no token
    count the op does not (push_cap <= capacity, oneshot, push_max_tokens)."""
    slots = max(world, 132 // world * world)
    lay = plan_layout(world=world, slots=slots, hidden=hidden, itemsize=itemsize, max_tokens=max_tokens,
                      max_bytes=budget, oneshot_max=oneshot, push_max=push)  # fmt: skip
    row = hidden * itemsize
    regions = [(0, lay.flags_bytes)]
    if lay.capacity:
        regions.append((lay.in_off, lay.in_off + lay.capacity * row))
        if lay.two_shot:
            regions.append((lay.sum_off, lay.sum_off + lay.capacity * row))
        assert lay.total_bytes <= budget
    if lay.push_cap:
        regions.append((lay.push_off, lay.push_off + 2 * world * lay.push_cap * row))
    for start, end in regions:
        assert start % ALIGN == 0 and 0 <= start <= end <= lay.total_bytes
    ordered = sorted(regions)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))
    assert lay.push_cap <= min(lay.capacity, oneshot, push, max_tokens)
    assert lay.two_shot == (lay.capacity > oneshot)


def _fake_comm(world: int = 2, rank: int = 0, gathered=None):
    """A Comm whose gather returns what each test scripts (or this rank's object on every rank)."""
    comm = types.SimpleNamespace(group=object(), world_size=world, rank=rank, device=torch.device("cpu"),
                                 cpu_group=object())  # fmt: skip
    script = list(gathered or [])
    comm.gather_objects = lambda obj: script.pop(0) if script else [obj] * world
    return comm


def _backend(max_tokens: int = 300, oneshot_max: int = 128, max_bytes: int = 1 << 30, push_max: int = 0):
    problem = make_problem(H, torch.bfloat16, world_size=2, max_tokens=max_tokens)
    lay = plan_layout(world=2, slots=4, hidden=H, itemsize=2, max_tokens=max_tokens, max_bytes=max_bytes,
                      oneshot_max=oneshot_max, push_max=push_max)  # fmt: skip
    ws = emulated(lay, torch.bfloat16)[0]
    settings = {"max_bytes": max_bytes, "oneshot_max_tokens": oneshot_max, "spin_limit": 1000}
    return TritonSymmBackend(problem, Comm(None, torch.device("cpu")), ws, settings)


def test_check_tokens_by_budget():
    """Token counts beyond what the budget holds are refused with the setting's name, so those calls
    fall through to the next backend (triton); input_buffer has no view for them either."""
    row = H * 2
    budget = 4 * row * 2 + 4096  # room for a few tokens of both regions, plus the flags
    b = _backend(max_tokens=300, oneshot_max=2, max_bytes=budget)
    cap = b.capacity
    assert 2 < cap < 300
    assert b.check_tokens(cap) == ()
    (reason,) = b.check_tokens(cap + 1)
    assert reason == f"tokens: {cap + 1} (needs <= {cap}, what ARNORM_TRITON_SYMM_MAX_BYTES={budget} holds)"
    assert b.input_buffer(cap + 1) is None


def test_create_rejects_a_budget_without_one_token(monkeypatch):
    """A budget below one row is a setup failure naming the variable and the bytes needed."""
    monkeypatch.setattr(B, "agree_topology", lambda comm: 4)
    problem = make_problem(H, torch.bfloat16, world_size=2)
    with pytest.raises(BackendSetupError, match=r"workspace: ARNORM_TRITON_SYMM_MAX_BYTES=100 holds no token "
                       r"of hidden size 256 in bfloat16 \(needs >= \d+\)"):  # fmt: skip
        TritonSymmBackend.create(problem, _fake_comm(), TritonSymmSettings(max_bytes=100))
    with pytest.raises(BackendSetupError, match=r"world size: 1 \(needs 2 to 8 ranks\)"):
        TritonSymmBackend.create(problem, Comm(None, torch.device("cpu")), TritonSymmSettings())


@pytest.mark.parametrize(
    ("world", "row_bytes", "tokens"),
    [(2, 16384, 128), (4, 16384, 128), (8, 16384, 32), (8, 8192, 64), (3, 16384, 128), (5, 16384, 32),
     (6, 65536, 8), (2, 1 << 20, 32), (8, 1 << 20, 0)],
)  # fmt: skip
def test_unset_crossovers_shrink_with_the_world_size(world, row_bytes, tokens):
    """One-shot and push serve at most 128 tokens, and at most 2 MiB (3-4 ranks) or 512 KiB (5-8) of
    a rank's partial: one-shot's traffic grows with the world size, two-shot's does not."""
    assert auto_oneshot_tokens(world, row_bytes) == tokens


@pytest.mark.parametrize(("world", "settings", "expect"), [
    (8, {}, (32, 32)),
    (2, {}, (128, 128)),
    (8, {"oneshot_max_tokens": 100, "push_max_tokens": 0}, (100, 0)),
    (8, {"push_max_tokens": 7}, (32, 7)),
])  # fmt: skip
def test_create_resolves_unset_crossovers_by_world_size(monkeypatch, world, settings, expect):
    """create() hands the layout the world-size default for an unset crossover and a set one as set."""
    import arnorm_triton.symm._workspace as W

    seen = {}

    def record(**kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(B, "agree_topology", lambda comm: 8)
    monkeypatch.setattr(W, "plan_layout", record)
    problem = make_problem(8192, torch.bfloat16, world_size=world)
    with pytest.raises(RuntimeError, match="stop here"):
        TritonSymmBackend.create(problem, _fake_comm(world), TritonSymmSettings(**settings))
    assert (seen["oneshot_max"], seen["push_max"]) == expect


def test_call_picks_the_kernel_variant(monkeypatch):
    """One-shot up to the crossover, two-shot above; a partial in the input buffer is not copied and
    its residual goes to a new tensor; once a buffer is lent every call waits at its end."""
    b = _backend(max_tokens=300, oneshot_max=128)
    calls = []
    monkeypatch.setattr(b.launcher, "launch", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(b.launcher, "wait_done", lambda **k: calls.append(("wait_done", {})))
    res, w = torch.zeros(300, H, dtype=torch.bfloat16), torch.ones(H, dtype=torch.bfloat16)
    for t in (1, 128, 129, 300):
        x = torch.zeros(t, H, dtype=torch.bfloat16)
        out = b(x, res[:t], w, None)
        _, kw = calls.pop()
        assert kw == {"push": False, "two_shot": t > 128, "copy_in": True, "end_wait": False, "warmup": False}
        assert out.residual is x  # in place
    view = b.input_buffer(5)
    assert calls.pop() == ("wait_done", {})
    assert view.shape == (5, H) and view.data_ptr() == b.workspace.input_ptr()
    out = b(view, res[:5], w, None)
    _, kw = calls.pop()
    assert kw == {"push": False, "two_shot": False, "copy_in": False, "end_wait": True, "warmup": False}
    assert out.residual.data_ptr() != view.data_ptr()
    b.input_buffer(5)
    assert not calls  # the wait runs once
    b(torch.zeros(3, H, dtype=torch.bfloat16), res[:3], w, None)
    assert calls.pop()[1]["end_wait"] is True
    b.close()
    b.close()
    with pytest.raises(arnorm.ArnormError, match="closed"):
        b(torch.zeros(3, H, dtype=torch.bfloat16), res[:3], w, None)


def test_warm_up_variants_are_safe_in_order():
    """Warm-up covers every variant a call can take, a zero-copy one only after one that waited at
    its end; only one-shot below the crossover, only two-shot with crossover 0."""
    assert _backend(max_tokens=64, oneshot_max=128)._variants() == [
        (False, False, True, False), (False, False, True, True), (False, False, False, True),
    ]  # fmt: skip
    assert [v[1] for v in _backend(max_tokens=300, oneshot_max=0)._variants()] == [True] * 3
    assert [v[1] for v in _backend(max_tokens=300, oneshot_max=128)._variants()] == [False] * 3 + [True] * 3
    with_push = _backend(max_tokens=300, oneshot_max=128, push_max=16)._variants()
    assert with_push[0] == (True, False, True, False) and not any(v[0] for v in with_push[1:])
    # Push is a way of running one-shot: none when every call is two-shot.
    assert not any(v[0] for v in _backend(max_tokens=300, oneshot_max=0, push_max=16)._variants())


def test_call_pushes_up_to_push_max_tokens(monkeypatch):
    """Calls up to push_max_tokens push (zero-copy ones too: the view is read locally), the rest
    of one-shot takes the flags; push calls never wait at their end."""
    b = _backend(max_tokens=300, oneshot_max=128, push_max=16)
    assert b.push_max_tokens == 16
    calls = []
    monkeypatch.setattr(b.launcher, "launch", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(b.launcher, "wait_done", lambda **k: None)
    res, w = torch.zeros(300, H, dtype=torch.bfloat16), torch.ones(H, dtype=torch.bfloat16)
    for t in (1, 16, 17, 129):
        b(torch.zeros(t, H, dtype=torch.bfloat16), res[:t], w, None)
        assert (calls.pop()["push"], t) == (t <= 16, t)
    view = b.input_buffer(4)
    out = b(view, res[:4], w, None)
    assert calls.pop()["push"] is True
    assert out.residual.data_ptr() != view.data_ptr()


# -- topology ----------------------------------------------------------------------------------


class _Props:
    def __init__(self, uuid: str, sms: int = 132) -> None:
        self.uuid, self.multi_processor_count = uuid, sms


def _topology(monkeypatch, facts, p2p=True, visible=("u0", "u1"), allow=False):
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: _Props(visible[i if isinstance(i, int) else 0])
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: p2p)
    if allow:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    else:
        monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", raising=False)
    comm = _fake_comm(len(facts), 0, [facts])
    comm.device = torch.device("cuda", 0)
    local = []
    comm.gather_objects = lambda obj: (
        facts if isinstance(obj, dict) else (local.append(obj) or [obj] * len(facts))
    )
    return comm


def test_topology_reasons(monkeypatch):
    """Ranks on two hosts, ranks sharing a GPU without torch's overlap switch, and peers without P2P
    are setup failures in the reason grammar; otherwise the program count is agreed (min SMs,
    a multiple of the world size)."""
    two_hosts = [{"host": "a", "uuid": "u0", "sms": 132}, {"host": "b", "uuid": "u1", "sms": 132}]
    with pytest.raises(BackendSetupError, match=r"nodes: ranks on 2 hosts \(needs every rank on one node"):
        agree_topology(_topology(monkeypatch, two_hosts))
    shared = [{"host": "a", "uuid": "u0", "sms": 132}] * 2
    with pytest.raises(
        BackendSetupError, match=r"devices: ranks \[0, 1\] share a GPU \(needs one GPU per rank"
    ):
        agree_topology(_topology(monkeypatch, shared))
    assert agree_topology(_topology(monkeypatch, shared, allow=True)) == 132
    apart = [{"host": "a", "uuid": "u0", "sms": 132}, {"host": "a", "uuid": "u1", "sms": 114}]
    with pytest.raises(
        BackendSetupError, match=r"peer access: cuda:0 cannot reach rank 1's cuda:1 \(needs P2P"
    ):
        agree_topology(_topology(monkeypatch, apart, p2p=False))
    assert agree_topology(_topology(monkeypatch, apart)) == 114
    four = [{"host": "a", "uuid": f"u{i}", "sms": 130} for i in range(4)]
    assert agree_topology(_topology(monkeypatch, four, visible=("u0", "u1", "u2", "u3"))) == 128


# -- joining torch symmetric memory (fakes: no GPU) ------------------------------------------------


def test_build_adds_each_ranks_offset():
    """Torch's pool may place the buffer inside a larger allocation at an offset that differs by
    rank: peer r's buffer is buffer_ptrs[r] + offset_r, and this rank's entry is its own tensor."""
    from arnorm_triton.symm._workspace import build, local_offset

    lay = plan_layout(world=2, slots=2, hidden=H, itemsize=2, max_tokens=4, max_bytes=1 << 20, oneshot_max=4)
    buf = torch.zeros(lay.total_bytes + 512, dtype=torch.uint8)[512:]
    base = buf.data_ptr() - 512
    handle = types.SimpleNamespace(buffer_ptrs=[base, 1 << 40])
    assert local_offset(buf, handle, 0) == 512
    ws = build(lay, 0, buf, handle, [512, 4096], torch.bfloat16)
    assert ws.peers.tolist() == [buf.data_ptr(), (1 << 40) + 4096]
    with pytest.raises(RuntimeError, match="not its own tensor"):
        build(lay, 0, buf, handle, [0, 0], torch.bfloat16)


def test_rendezvous_registers_the_group_only_when_torch_needs_it(monkeypatch):
    """On a torch that needs enable_symm_mem_for_group, the first rendezvous fails, the TP group (not
    WORLD) is registered and the rendezvous retried; a registered group's failure is raised as is."""
    from torch.distributed import _symmetric_memory as symm_mem

    from arnorm_triton.symm._workspace import rendezvous

    group = types.SimpleNamespace(group_name="tp7")
    seen, enabled = [], set()

    def fake_rendezvous(buf, g):
        seen.append(g)
        if "tp7" not in enabled:
            raise RuntimeError("SymmetricMemory: group_info not found for tp7")
        return "handle"

    monkeypatch.setattr(symm_mem, "rendezvous", fake_rendezvous)
    monkeypatch.setattr(symm_mem, "is_symm_mem_enabled_for_group", lambda name: name in enabled)
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", enabled.add)
    assert rendezvous(object(), group) == "handle"
    assert seen == [group, group] and enabled == {"tp7"}
    enabled.clear()
    monkeypatch.setattr(symm_mem, "is_symm_mem_enabled_for_group", lambda name: True)
    with pytest.raises(RuntimeError, match="group_info"):
        rendezvous(object(), group)


def test_a_step_failing_on_one_rank_fails_on_every_rank():
    """Allocation, rendezvous, compile and warm-up are each agreed: a rank whose step raised makes
    every rank raise the same setup error, naming the rank, instead of leaving peers waiting."""
    ok = _fake_comm(2, 0, [["", "RuntimeError: CUDA out of memory"]])
    with pytest.raises(
        BackendSetupError, match=r"symmetric memory: rank 1: RuntimeError: CUDA out of memory"
    ):
        collective_step(ok, "symmetric memory", lambda: None)
    collective_step(_fake_comm(2, 0, [["", ""]]), "warm-up", lambda: None)
