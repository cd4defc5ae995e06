"""Calls that must never be silently wrong: aliasing, grad, meta, missing or swapped weights, threads."""

from __future__ import annotations

import threading

import pytest
import torch
from call_kinds import variant
from hypothesis import given, settings
from hypothesis import strategies as st

import arnorm
from arnorm._reference import add_rmsnorm

import fake_backends

H = 8


@pytest.fixture(autouse=True)
def _reference_only():
    """The core's own behaviour is checked against the reference alone (no plugin, no interpreter)."""
    fake_backends.install()


def make(**kw) -> arnorm.AllReduceNorm:
    base = dict(hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=8)
    base.update(kw)
    return arnorm.AllReduceNorm(arnorm.LOCAL, **base)


def rand(*shape, **kw):
    return torch.randn(*shape, **kw)


# -- aliasing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "residual_of",
    [
        lambda x, buf: x,
        lambda x, buf: x.view(4, H),
        lambda x, buf: buf[2:6],  # overlaps rows 2..3 of x = buf[0:4]
        lambda x, buf: buf.view(-1)[4 : 4 + 4 * H].view(4, H),  # overlaps by half a row
    ],
)
def test_a_residual_overlapping_hidden_states_is_rejected_and_nothing_is_written(clean_env, residual_of):
    """Any overlap of residual with hidden_states' bytes is rejected before the backend runs."""
    buf = rand(8, H)
    x = buf[0:4]
    before = buf.clone()
    with (
        make() as op,
        pytest.raises(arnorm.InvalidInputError, match=r"residual: overlaps hidden_states' memory"),
    ):
        op(x, residual_of(x, buf), rand(H))
    assert torch.equal(buf, before)


def test_disjoint_rows_of_one_buffer_are_fine(clean_env):
    """hidden_states and residual may share a storage when their bytes do not overlap."""
    buf = rand(8, H)
    x, r, w = buf[0:4], buf[4:8], rand(H)
    expect = add_rmsnorm(x.clone(), r.clone(), w, 1e-6, 0.0)
    with make() as op:
        out = op(x, r, w)
    assert torch.equal(out.residual, expect[0]) and torch.equal(out.normed, expect[1])


def test_a_weight_inside_hidden_states_is_rejected(clean_env):
    """The weight must not alias the buffer the op writes (hidden_states when in place)."""
    x = rand(4, H)
    with make() as op, pytest.raises(arnorm.InvalidInputError, match=r"weight: overlaps hidden_states"):
        op(x, rand(4, H), x[1])


# -- grad, meta, missing and swapped arguments ------------------------------------------------------


def test_a_leaf_requiring_grad_is_rejected_before_an_in_place_write(clean_env):
    """In place on a leaf that requires grad would corrupt autograd: rejected, the leaf unchanged."""
    x = rand(4, H, requires_grad=True)
    before = x.detach().clone()
    with (
        make() as op,
        pytest.raises(arnorm.InvalidInputError, match=r"hidden_states: a leaf tensor that requires grad"),
    ):
        op(x, rand(4, H), rand(H))
    assert torch.equal(x.detach(), before)


def test_meta_tensors_are_rejected_on_a_cpu_op(clean_env):
    """A meta tensor has no data: a CPU op rejects it by device."""
    with make() as op, pytest.raises(arnorm.InvalidInputError, match=r"hidden_states: device meta"):
        op(torch.empty(4, H, device="meta"), rand(4, H), rand(H))


@pytest.mark.parametrize(("quant", "missing"), [(None, "weight"), ("fp8_static", "scale")])
def test_none_weight_or_scale_on_the_first_call_is_rejected(clean_env, quant, missing):
    """A missing weight or scale is a bad argument on the first call of a new op, too."""
    x, r, w, s = rand(4, H), rand(4, H), rand(H), torch.tensor([0.5])
    args = {"weight": (x, r, None, s if quant else None), "scale": (x, r, w, None)}[missing]
    with (
        make(quant=quant) as op,
        pytest.raises(
            arnorm.InvalidInputError,
            match={
                "weight": r"^weight: NoneType \(needs a torch.Tensor\)",
                "scale": r"^scale: missing \(needs the fp32 \[1\]",
            }[missing],
        ),
    ):
        op(*args)


def test_a_weight_whose_storage_was_swapped_is_checked_again(clean_env):
    """w.data = ... after a first call: a wrong shape is rejected, a new buffer is read correctly."""
    x, r, w = rand(4, H), rand(4, H), rand(H)
    with make(inplace=False) as op:
        op(x, r, w)
        w.data = rand(H // 2)
        with pytest.raises(arnorm.InvalidInputError, match=r"weight: shape \[4\] \(needs \[8\]\)"):
            op(x, r, w)
        w.data = rand(H)
        assert torch.equal(op(x, r, w).normed, add_rmsnorm(x.clone(), r, w, 1e-6, 0.0)[1])


# -- one predicate: the fast path and check_call accept exactly the same inputs ---------------------


KINDS = st.sampled_from(
    ["ok", "view_alias", "overlap", "disjoint", "dtype", "res_dtype", "w_dtype", "shape", "res_shape",
     "w_shape", "strided", "transposed", "too_many", "meta", "w_in_x", "no_scale", "extra_scale",
     "scale_in_x", "leaf_grad", "not_tensor", "w_none", "x_neg", "res_neg", "w_neg", "scale_neg"]
)  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(kind=KINDS, quant=st.sampled_from([None, "fp8_static"]), inplace=st.booleans(), warm=st.booleans())
def test_the_fast_path_accepts_exactly_what_check_call_accepts(
    kind, quant, inplace, warm, monkeypatch_module
):
    """For every input, the inline fast predicate of __call__ and check_call agree (issue 11.7)."""
    import arnorm.op._call as op_module
    from arnorm.op._call import check_call

    fake_backends.install()
    slow = []
    real = op_module.check_call

    def recording(*args):
        slow.append(True)
        return real(*args)

    monkeypatch_module.setattr(op_module, "check_call", recording)
    x, r, w = rand(4, H), rand(4, H), rand(H)
    s = torch.tensor([0.5]) if quant else None
    with make(quant=quant, inplace=inplace) as op:
        if warm:  # the trust tables hold the good weight and scale already
            op(x.clone(), r, w, s)
            slow.clear()
        args = variant(kind, x, r, w, s)
        try:
            check_call(op._plan.rules, *args)
            check_ok = True
        except arnorm.InvalidInputError:
            check_ok = False
        try:
            op(*args)
            call_ok = True
        except arnorm.InvalidInputError:
            call_ok = False
    assert call_ok == check_ok, kind
    assert (not slow) == check_ok, (
        f"{kind}: fast path {'rejected' if slow else 'accepted'}, check_call {check_ok}"
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


# -- threads -----------------------------------------------------------------------------------------


class BlockingBackend(fake_backends.AllReduceBackend):
    """Blocks inside a call (or inside create) until released, to make two threads meet."""

    name = "blocking"
    entered = threading.Event()
    release = threading.Event()
    block_create = False

    @classmethod
    def create(cls, problem, comm, settings):
        if cls.block_create:
            cls.entered.set()
            cls.release.wait(10)
        return cls(problem, comm)

    def __call__(self, *args):
        type(self).entered.set()
        type(self).release.wait(10)
        return super().__call__(*args)


fake_backends.BlockingBackend = BlockingBackend  # importable by the loader string


def _reset_blocking(block_create: bool) -> None:
    BlockingBackend.entered = threading.Event()
    BlockingBackend.release = threading.Event()
    BlockingBackend.block_create = block_create
    fake_backends.install(fake_backends.spec("blocking", 50, "BlockingBackend"))


def test_a_concurrent_call_from_a_second_thread_raises(clean_env):
    """Two threads calling one op at once: the second raises instead of corrupting the first."""
    _reset_blocking(block_create=False)
    with make(backend="blocking") as op:
        x, r, w = rand(4, H), rand(4, H), rand(H)
        first = threading.Thread(target=op, args=(x, r, w))
        first.start()
        assert BlockingBackend.entered.wait(10)
        try:
            with pytest.raises(arnorm.InvalidInputError, match=r"op: called from two threads at once"):
                op(x.clone(), r, w)
        finally:
            BlockingBackend.release.set()
            first.join()
        op(x.clone(), r, w)  # and the op still works afterwards


def test_building_ops_from_two_threads_at_once_raises(clean_env):
    """Construction is collective and ordered: a second thread building meanwhile is refused."""
    _reset_blocking(block_create=True)
    errors = []
    first = threading.Thread(target=lambda: make(backend="blocking").close())
    first.start()
    assert BlockingBackend.entered.wait(10)
    try:
        make(backend="blocking")
    except arnorm.InvalidInputError as exc:
        errors.append(str(exc))
    finally:
        BlockingBackend.release.set()
        first.join()
    assert errors and errors[0].startswith("AllReduceNorm: built from two threads at once")
    make(backend="reference").close()  # the lock was released


# -- leaks, autograd, compile -----------------------------------------------------------------------


def test_ops_leave_no_custom_op_handles_behind(clean_env):
    """Closed ops and ops dropped without close() free their custom-op handles."""
    import gc

    from arnorm.op._custom_op import live_handles

    fake_backends.install()
    base = live_handles()
    for i in range(20):
        op = make()
        if i % 2:
            op.close()
        del op
    gc.collect()
    assert live_handles() == base


class Layer(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.weight = torch.nn.Parameter(torch.randn(H))

    def forward(self, x, r):
        out = self.op(x, r, self.weight)
        return out.normed, out.residual


@pytest.mark.parametrize("compiled", [False, True])
def test_inference_with_grad_enabled_works_and_backward_says_inference_only(clean_env, compiled):
    """Parameters that require grad (no no_grad): the forward runs, a backward raises InferenceOnlyError."""
    fake_backends.install()
    with make(inplace=False) as op:
        layer = Layer(op)
        fn = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        x, r = rand(4, H), rand(4, H)
        normed, residual = fn(x, r)
        expect = add_rmsnorm(x.clone(), r, layer.weight.detach(), 1e-6, 0.0)
        assert torch.equal(normed.detach(), expect[1]) and torch.equal(residual.detach(), expect[0])
        with pytest.raises(arnorm.InferenceOnlyError, match="inference only"):
            normed.sum().backward()
