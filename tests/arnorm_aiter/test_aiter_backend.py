"""``AiterBackend`` against the recording fake: setup, every supported call's arguments, capture, close."""

from __future__ import annotations

import itertools

import pytest
import torch
from aiter_fake import FakeComm, inputs, install, problem

import arnorm
import arnorm.quant
from arnorm._errors import BackendSetupError
from arnorm_aiter import _backend, _numerics, _rules
from arnorm_aiter._backend import AiterBackend


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


def build(fake, **overrides):
    prob = problem(**overrides)
    comm = FakeComm(prob.world_size)
    return prob, comm, AiterBackend.create(prob, comm, arnorm.Config())


# -- setup ------------------------------------------------------------------------------------


def test_create_builds_one_communicator_on_the_cpu_group(fake):
    prob, comm, backend = build(fake, max_tokens=300, hidden_size=4096)
    assert fake.inits == [{"group": "gloo-twin", "device": torch.device("cpu"), "max_size": 3 << 20}]
    assert comm.gathered == ["", ""]  # the import and the setup were agreed
    assert backend.check_tokens(300) == backend.check_tokens(384) == ()  # 3 MiB holds 384 rows
    assert backend.check_tokens(385) == tuple(_rules.token_reasons(prob, 385, 3 << 20)) != ()


@pytest.mark.parametrize(
    "exc", [SystemExit("[aiter] build [module_custom_all_reduce] failed"), ImportError("no hip")]
)
def test_import_failure_raises_on_every_rank(fake, monkeypatch, exc):
    def load():
        raise exc

    monkeypatch.setattr(_backend, "_load_communicator", load)
    comm = FakeComm(2)
    with pytest.raises(BackendSetupError, match=rf"aiter import: rank 0: import .*{type(exc).__name__}"):
        AiterBackend.create(problem(), comm, arnorm.Config())
    assert fake.inits == []
    assert len(comm.gathered) == 1


def test_a_peer_import_failure_stops_this_rank_before_any_collective(fake):
    comm = FakeComm(2, rank=0, others=[["import aiter: SystemExit: build failed"]])
    with pytest.raises(BackendSetupError, match="rank 1: import aiter: SystemExit"):
        AiterBackend.create(problem(), comm, arnorm.Config())
    assert fake.inits == []


def test_constructor_error_is_agreed(fake):
    fake.init_error = RuntimeError("hipIpcGetMemHandle failed")
    with pytest.raises(BackendSetupError, match="aiter setup: rank 0: CustomAllreduce: RuntimeError: hipIpc"):
        AiterBackend.create(problem(), FakeComm(2), arnorm.Config())


def test_disabled_communicator_is_a_setup_failure(fake):
    fake.disabled = True
    with pytest.raises(BackendSetupError, match=r"disabled itself \(needs every rank on one node"):
        AiterBackend.create(problem(), FakeComm(2), arnorm.Config())
    assert fake.events == ["close"]


def test_a_peer_setup_failure_releases_this_rank(fake):
    comm = FakeComm(4, rank=2, others=[["", "", ""], ["", "CustomAllreduce: RuntimeError: OOM", ""]])
    with pytest.raises(BackendSetupError, match="rank 1: CustomAllreduce: RuntimeError: OOM"):
        AiterBackend.create(problem(world_size=4), comm, arnorm.Config())
    assert fake.events == ["close"]


def test_single_process_comm_is_refused(fake):
    comm = FakeComm(2)
    comm.cpu_group = None
    with pytest.raises(BackendSetupError, match="needs 2 ranks with a CPU group"):
        AiterBackend.create(problem(), comm, arnorm.Config())


# -- calls: every supported case --------------------------------------------------------------

CASES = [
    c
    for c in itertools.product(
        ["bfloat16", "float16"],
        [0.0, 1.0],
        [None, "fp8_per_token"],
        [True, False],  # normed_output
        [True, False],  # inplace
        [2, 4, 8],
    )
    if c[2] is not None or c[3]  # the op refuses normed_output=False without a quant format
]


@pytest.mark.parametrize(("dtype", "offset", "quant", "normed", "inplace", "world"), CASES)
@pytest.mark.parametrize("tokens", [3, 96])
def test_call_arguments_and_outputs(fake, dtype, offset, quant, normed, inplace, world, tokens):
    hidden = 1024
    prob, _, backend = build(
        fake,
        dtype=dtype,
        weight_offset=offset,
        quant=quant,
        normed_output=normed,
        inplace=inplace,
        world_size=world,
        hidden_size=hidden,
    )
    partials, residual, weight = inputs(world, tokens, hidden, getattr(torch, dtype))
    fake.partials = partials
    x, res_before = partials[0].clone(), residual.clone()
    fake.partials[0] = x.clone()
    assert backend.check_tokens(tokens) == ()
    out = backend(x, residual, weight, None)

    (call,) = fake.calls
    assert call["inp"] is x and call["res_inp"] is residual and call["w"] is weight
    assert call["eps"] == prob.eps
    assert call["registered"] is False
    assert call["use_1stage"] is _rules.use_one_stage(tokens, hidden, 2, world) is (tokens == 3)
    assert call["gemma_norm"] is (offset == 1.0)
    assert call["out_hidden_dim"] == 0
    assert torch.equal(residual, res_before)
    if inplace:
        assert call["res_out"] is x and out.residual is x
    else:
        assert out.residual is call["res_out"]
        assert out.residual.data_ptr() not in (x.data_ptr(), residual.data_ptr())
        assert torch.equal(x, partials[0])
    if quant is None:
        assert (
            call["post_per_token_quant"] is False and call["scale_out"] is None and call["emit_bf16"] is False
        )
        assert out.normed is call["out"] and out.quant is None
    else:
        assert call["post_per_token_quant"] is True and call["emit_bf16"] is normed
        q = out.quant
        assert q.data is call["out"] and q.scale is call["scale_out"]
        assert (q.format, q.layout, q.global_scale) == ("fp8_per_token", None, None)
        like = arnorm.quant.quantize(torch.ones(tokens, hidden, dtype=getattr(torch, dtype)), "fp8_per_token")
        assert (q.data.dtype, q.data.shape, q.scale.dtype, q.scale.shape) == (
            like.data.dtype,
            like.data.shape,
            like.scale.dtype,
            like.scale.shape,
        )
        assert (out.normed is not None) is normed
    if out.normed is not None:
        assert (out.normed.dtype, out.normed.shape) == (getattr(torch, dtype), (tokens, hidden))
    # The fake computes what AITER's kernels compute: hold it to the documented tolerance.
    dev = _numerics.deviation(out, _ref_output(prob, partials, residual, weight))
    assert _numerics.violations(dev) == [], str(dev)


def _ref_output(prob, partials, residual, weight):
    from arnorm._reference import add_rmsnorm, quantize_output, rank_order_sum

    h, y = add_rmsnorm(rank_order_sum(partials), residual, weight, prob.eps, prob.weight_offset)
    return arnorm.Output(y, h, quantize_output(y, prob.quant, None, None))


def test_stage_choice_is_cached_per_token_count(fake, monkeypatch):
    _, _, backend = build(fake, world_size=8)
    seen = []
    monkeypatch.setattr(_rules, "use_one_stage", lambda *a: seen.append(a) or True)
    for _ in range(3):
        backend(
            torch.ones(4, 4096, dtype=torch.bfloat16),
            torch.ones(4, 4096, dtype=torch.bfloat16),
            torch.ones(4096, dtype=torch.bfloat16),
            None,
        )
    assert seen == [(4, 4096, 2, 8)]


# -- CUDA-graph capture -----------------------------------------------------------------------


def _call(backend, tokens=2, hidden=4096):
    t = torch.ones(tokens, hidden, dtype=torch.bfloat16)
    return backend(t, t.clone(), torch.ones(hidden, dtype=torch.bfloat16), None)


@pytest.mark.parametrize(
    ("inplace", "register_ok", "stream_capturing", "registered"),
    [
        (False, True, True, True),  # the zero-copy capture path
        (False, True, False, False),  # a warm-up run inside the context
        (True, True, True, False),  # in place: peers would read the buffer being overwritten
        (False, False, True, False),  # expandable segments: AITER cannot IPC-export the input
    ],
)
def test_capture_context(fake, monkeypatch, inplace, register_ok, stream_capturing, registered):
    fake.register_for_capturing = register_ok
    _, _, backend = build(fake, inplace=inplace)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: stream_capturing)
    with backend.capture() as b:
        assert b is backend
        _call(backend)
        assert fake.events == ["capture:enter"]
    assert fake.events == ["capture:enter", "capture:flush"]
    assert fake.calls[0]["registered"] is registered and fake.calls[0]["capturing"]
    _call(backend)
    assert fake.calls[1]["registered"] is False


def test_outside_the_context_capture_copies_in(fake, monkeypatch):
    _, _, backend = build(fake, inplace=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: pytest.fail("checked eagerly"))
    _call(backend)
    assert fake.calls[0]["registered"] is False


# -- close ------------------------------------------------------------------------------------


def test_close_is_idempotent(fake):
    _, _, backend = build(fake)
    backend.close()
    backend.close()
    assert fake.events == ["close"]
    with pytest.raises(BackendSetupError, match="closed"), backend.capture():
        pass
