"""The checked call: the fast path a backend may offer (``fast_path``), and when it is taken."""

from __future__ import annotations

import pytest
import torch

import arnorm
from arnorm.plugin import Capabilities, add_rmsnorm

import fake_backends as fb

H = 32
ALL_QUANT, WRITES_OUT = fb.ALL_QUANT, fb.WRITES_OUT


def make(**kw) -> arnorm.AllReduceNorm:
    base = dict(
        hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=8, backend="fastpath"
    )
    base.update(kw)
    return arnorm.AllReduceNorm(arnorm.LOCAL, **base)


def inputs(t=3):
    g = torch.Generator().manual_seed(t)
    return torch.randn(t, H, generator=g), torch.randn(t, H, generator=g), torch.randn(H, generator=g)


def test_contiguous_call_goes_through_the_fast_path_with_the_data_pointers(fastpath):
    """A valid contiguous call reaches fast(t, tensors..., out, pointers) and not __call__."""
    x, r, w = inputs()
    expect_h, expect_y = add_rmsnorm(x, r, w, 1e-6, 0.0)
    with make() as op:
        got = op(x, r, w)
    ((t, gx, gr, gw, gs, out, xp, rp, wp, sp),) = fastpath.fast_calls
    assert (t, out, gs, sp) == (3, None, None, 0)
    assert gx is x and gr is r and gw is w
    assert (xp, rp, wp) == (x.data_ptr(), r.data_ptr(), w.data_ptr())
    assert fastpath.slow_calls == []
    assert torch.equal(got.residual, expect_h) and torch.equal(got.normed, expect_y)


def test_out_and_scale_reach_the_fast_path(fastpath):
    """out= is checked by the core and handed over; the scale's pointer comes with it."""
    x, r, w = inputs()
    s = torch.tensor([0.05])
    with make(quant="fp8_static") as op:
        out = op.empty_output(3, s)
        got = op(x, r, w, s, out=out)
        call = fastpath.fast_calls[-1]
        assert call[5] is out and call[4] is s and call[9] == s.data_ptr()
        assert got.normed is out.normed and got.quant.data is out.quant.data
        with pytest.raises(arnorm.InvalidInputError, match=r"out.normed: overlaps hidden_states"):
            op(x, r, w, s, out=arnorm.Output(x, None, out.quant))
    assert len(fastpath.fast_calls) == 1  # the overlapping out never reached the backend
    assert fastpath.slow_calls == []


def test_declined_fast_path_falls_back_to_call(fastpath):
    """fast(...) returning None sends the same call to __call__, which gives the result."""
    fastpath.decline = True
    x, r, w = inputs()
    expect_h, _ = add_rmsnorm(x, r, w, 1e-6, 0.0)
    with make() as op:
        got = op(x, r, w)
    assert len(fastpath.fast_calls) == 1 and fastpath.slow_calls == [3]
    assert torch.equal(got.residual, expect_h)


def test_strided_rows_and_rejected_input_skip_the_fast_path(fastpath):
    """Strided rows go to __call__; invalid input raises before any backend runs."""
    x, r, w = inputs()
    wide = torch.zeros(3, 2 * H)
    wide[:, :H] = x
    with make() as op:
        op(wide[:, :H], r, w)
        assert fastpath.fast_calls == [] and fastpath.slow_calls == [3]
        with pytest.raises(arnorm.InvalidInputError, match="residual: dtype"):
            op(x, r.double(), w)
    assert fastpath.fast_calls == [] and fastpath.slow_calls == [3]


def test_no_residual_call_hands_a_zero_residual_pointer(fastpath):
    """add_residual=False: fast(...) gets residual None and residual pointer 0."""
    x, _, w = inputs()
    caps = Capabilities(
        platforms=frozenset({"cpu"}), quant=ALL_QUANT, caller_outputs=True, residual_free=True
    )
    fb.install(fb.spec("fastpath", 50, "FastPathBackend", caps=caps))
    with make(add_residual=False) as op:
        op(x, None, w)
    ((t, _, res, _, _, _, xp, rp, wp, _),) = fastpath.fast_calls
    assert (t, res, rp, xp, wp) == (3, None, 0, x.data_ptr(), w.data_ptr())


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (RuntimeError("no launcher"), "fast_path\\(\\) raised RuntimeError: no launcher"),
        (None, "returned int"),
    ],
)
def test_broken_fast_path_warns_and_calls_go_through_call(fastpath, monkeypatch, error, message):
    """A fast_path() that raises or returns a non-function costs speed only: a warning, then __call__."""
    if error is not None:
        fastpath.fast_path_error = error
    else:
        monkeypatch.setattr(fastpath, "fast_path", lambda self: 7)
    x, r, w = inputs()
    with pytest.warns(arnorm.ArnormWarning, match=message), make() as op:
        op(x, r, w)
    assert fastpath.fast_calls == [] and fastpath.slow_calls == [3]


def test_fast_path_is_not_used_without_caller_outputs(fastpath):
    """A backend that does not write caller outputs is served out= by a copy, never by its fast path."""
    fb.install(fb.spec("fastpath", 50, "FastPathBackend"))
    x, r, w = inputs()
    with make() as op:
        op(x, r, w, out=op.empty_output(3))
        op(x, r, w)
    assert fastpath.fast_calls == [] and fastpath.slow_calls == [3, 3]


def test_closed_op_raises_instead_of_taking_the_fast_path(fastpath):
    """After close() the fast path table is empty: a call raises 'closed'."""
    x, r, w = inputs()
    op = make()
    op.close()
    with pytest.raises(arnorm.InvalidInputError, match="op: closed"):
        op(x, r, w)
    assert fastpath.fast_calls == []


def test_grad_mode_result_of_the_fast_path_is_guarded(fastpath):
    """A fast-path result computed from tensors that require grad raises on backward."""
    x, r, w = inputs()
    w.requires_grad_(True)
    with make() as op:
        got = op(x, r, w)
    assert len(fastpath.fast_calls) == 1
    with pytest.raises(arnorm.InferenceOnlyError):
        got.normed.sum().backward()
