"""Calls that must never be wrong or torn, in one process (issue 41): ``out=`` under ``torch.compile``,
a plugin's outputs, tensors made under ``torch.inference_mode()``, and the errors of a compiled call
after ``close()`` and of a re-entrant call.

The multi-rank cases (an interrupt inside a call, a call rejected on one rank only, check mode's
timeouts) are in test_faults_steps.py.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import arnorm
from arnorm._reference import add_rmsnorm

import fake_backends

H = 32
EPS = 1e-6


def _op(**kw) -> arnorm.AllReduceNorm:
    args = dict(hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(EPS), device="cpu", max_tokens=8)
    args.update(kw)
    return arnorm.AllReduceNorm(arnorm.LOCAL, **args)


def _inputs(t: int = 3):
    g = torch.Generator().manual_seed(t)
    return torch.randn(t, H, generator=g), torch.randn(t, H, generator=g), torch.randn(H, generator=g)


# -- item 3: out= under torch.compile ---------------------------------------------------------------


@pytest.mark.parametrize("field", ["residual", "normed"])
def test_compiled_call_refuses_an_out_buffer_overlapping_an_input_like_eager(clean_env, field):
    """out.residual (or out.normed) is the caller's residual: eager refuses it; the compiled call
    refuses it with the same error instead of overwriting the residual, also for buffers it was not
    compiled with."""
    with _op(inplace=False) as op:

        def step(x, r, w, out):
            return op(x, r, w, out=out).residual

        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        x, r, w = _inputs()
        good = op.empty_output(3)
        expect_h, _ = add_rmsnorm(x, r, w, EPS, 0.0)
        assert torch.equal(compiled(x, r, w, good), expect_h)  # compiled, and correct
        x, r, w = _inputs()
        keep = r.clone()
        bad = op.empty_output(3)
        bad = arnorm.Output(
            r if field == "normed" else bad.normed, r if field == "residual" else bad.residual, None
        )
        message = rf"out\.{field}: overlaps residual \(needs a separate buffer\)"
        with pytest.raises(arnorm.InvalidInputError, match=message):
            op(x, r, w, out=bad)
        with pytest.raises(arnorm.InvalidInputError, match=message):
            compiled(x, r, w, bad)
        assert torch.equal(r, keep)  # the caller's residual is untouched


# -- item 9: errors that say what happened ----------------------------------------------------------


def test_compiled_call_after_close_says_the_op_is_closed(clean_env):
    """A compiled function called after its op was closed raises the eager call's error."""
    op = _op()

    def step(x, r, w):
        return op(x, r, w).residual

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, r, w = _inputs()
    compiled(x.clone(), r, w)
    op.close()
    with pytest.raises(arnorm.InvalidInputError, match=r"^op: closed \(needs a new arnorm\.AllReduceNorm"):
        op(x.clone(), r, w)
    with pytest.raises(arnorm.InvalidInputError, match=r"^op: closed \(needs a new arnorm\.AllReduceNorm"):
        compiled(x.clone(), r, w)


class _Reenters(fake_backends.AllReduceBackend):
    """Calls the op it serves from inside its own call (a hook gone wrong)."""

    name: ClassVar[str] = "reenters"
    op: ClassVar[list] = []

    def __call__(self, hidden_states, residual, weight, scale):
        type(self).op[0](hidden_states.clone(), residual, weight)
        return super().__call__(hidden_states, residual, weight, scale)


def test_a_reentrant_call_is_named_as_such_not_as_two_threads(clean_env, monkeypatch):
    monkeypatch.setattr(fake_backends, "Reenters", _Reenters, raising=False)
    fake_backends.install(fake_backends.spec("reenters", 70, "Reenters"))
    with _op(backend="reenters") as op:
        _Reenters.op[:] = [op]
        x, r, w = _inputs()
        with pytest.raises(arnorm.InvalidInputError) as info:
            op(x, r, w)
        message = str(info.value)
        assert "two threads" not in message, message
        assert message.startswith("op: called again from inside its own call on this thread"), message
        _Reenters.op[:] = []


# -- item 6: tensors made under torch.inference_mode() ----------------------------------------------


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("with_out", [False, True])
def test_tensors_made_under_inference_mode_work_outside_it(clean_env, inplace, with_out):
    """Inputs (and out= buffers) made under inference_mode, the call made outside it, at TP 1: the
    result is the reference's; an in-place op, which torch lets write hidden_states before it
    raises, says what happened and the fix (at TP > 1 it works: test_faults_steps.py)."""
    with _op(inplace=inplace, backend="reference") as op:  # its in-place write is a torch op
        with torch.inference_mode():
            x, r, w = _inputs()
            out = op.empty_output(3) if with_out else None
        expect_h, expect_y = add_rmsnorm(x, r, w, EPS, 0.0)
        for _ in range(2):  # the first call (checked in full) and a trusted one
            if inplace:
                with pytest.raises(arnorm.InvalidInputError, match=r"^hidden_states: an inference tensor"):
                    op(torch.inference_mode()(x.clone)(), r, w, out=out)
                continue
            got = op(x.clone(), r, w, out=out)
            assert torch.equal(got.residual, expect_h) and torch.equal(got.normed, expect_y)


def test_an_out_made_under_inference_mode_is_named_in_the_error(clean_env):
    """TP 1, an in-place op: only out= was made under inference_mode. torch refuses the write into
    out.normed after the residual was written in place, so the call cannot be made again: the error
    names out.normed, the inference tensor, not hidden_states, which is not one."""
    with _op(backend="reference") as op:
        x, r, w = _inputs()
        with torch.inference_mode():
            out = op.empty_output(3)
        with pytest.raises(arnorm.InvalidInputError, match=r"^out\.normed: an inference tensor") as info:
            op(x.clone(), r, w, out=out)
        assert "hidden_states: an inference" not in str(info.value)


# -- item 4: a plugin's outputs ---------------------------------------------------------------------


class _Returns(fake_backends.AllReduceBackend):
    """Right until ``bad`` says what to return instead of its Output."""

    name: ClassVar[str] = "returns"
    bad: ClassVar[list] = [""]

    def __call__(self, hidden_states, residual, weight, scale):
        got = super().__call__(hidden_states, residual, weight, scale)
        how = type(self).bad[0]
        if how == "none":
            return None
        if how == "float32 normed":
            return arnorm.plugin.Output(got.normed.float(), got.residual, got.quant)
        if how == "short residual":
            return arnorm.plugin.Output(got.normed, got.residual[:-1], got.quant)
        if how == "no normed":
            return arnorm.plugin.Output(None, got.residual, got.quant)
        if how == "short normed":
            return arnorm.plugin.Output(got.normed[:-1], got.residual, got.quant)
        return got


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("none", "None (needs an arnorm.plugin.Output"),
        ("float32 normed", "Output.normed: dtype torch.float32 (needs torch.bfloat16)"),
        ("short residual", "Output.residual: shape [2, 32] (needs [3, 32])"),
        ("no normed", "Output.normed: NoneType (needs a torch.Tensor of shape [3, 32])"),
    ],
)
def test_a_backend_returning_the_wrong_outputs_raises_naming_it(clean_env, monkeypatch, bad, says):
    """What a backend returns is checked on its first call per token count: missing, mistyped or
    misshapen outputs raise BackendBrokenError naming the backend, not reach the caller."""
    monkeypatch.setattr(fake_backends, "Returns", _Returns, raising=False)
    fake_backends.install(fake_backends.spec("returns", 70, "Returns"))
    with _op(backend="returns", dtype=torch.bfloat16) as op:
        x, r, w = (t.bfloat16() for t in _inputs())
        _Returns.bad[0] = bad
        try:
            with pytest.raises(arnorm.BackendBrokenError) as info:
                op(x.clone(), r, w)
        finally:
            _Returns.bad[0] = ""
        assert str(info.value).startswith(f"backend 'returns': its call for 3 tokens returned {says}"), (
            info.value
        )
        got = op(x.clone(), r, w)  # a right result is then trusted for the token count
        assert got.normed.dtype == torch.bfloat16 and op.backend_for(3) == "returns"
        assert op.explain(3).token_backend == "returns"


@pytest.mark.parametrize("tokens", [2, 4])
@pytest.mark.parametrize("bad", ["short normed", "float32 normed"])
def test_a_wrong_result_raises_the_same_error_with_out_and_out_is_never_written(
    clean_env, monkeypatch, bad, tokens
):
    """A backend (no caller_outputs) returning normed of the wrong shape or dtype: with out= the call
    raises the BackendBrokenError it raises without out= (not torch's broadcast error, nor a [1, H]
    row broadcast into out.normed at T = 2), and out is left as it was: checked before copying."""
    monkeypatch.setattr(fake_backends, "Returns", _Returns, raising=False)
    fake_backends.install(fake_backends.spec("returns", 70, "Returns"))
    with _op(backend="returns", dtype=torch.bfloat16) as op:
        x, r, w = (t.bfloat16() for t in _inputs(tokens))
        out = op.empty_output(tokens)
        out.normed.fill_(7.0)
        errors = []
        _Returns.bad[0] = bad
        try:
            for given in (None, out, out):  # without out=, then with it, twice
                with pytest.raises(arnorm.BackendBrokenError) as info:
                    op(x.clone(), r, w, out=given)
                errors.append(str(info.value))
        finally:
            _Returns.bad[0] = ""
        assert errors[0].startswith(
            f"backend 'returns': its call for {tokens} tokens returned Output.normed: "
        )
        assert errors == [errors[0]] * 3, errors
        assert bool((out.normed == 7.0).all()), "out was written from a wrong result"
        assert op(x.clone(), r, w, out=out).normed is out.normed  # a right result then fills out


def test_a_fast_path_returning_the_wrong_outputs_raises_naming_it(fastpath, monkeypatch):
    """The same check for a backend's fast path."""
    B = fake_backends.FastPathBackend
    real = B.fast_path

    def bad_fast_path(self):
        fast = real(self)

        def wrong(*args):
            got = fast(*args)
            return None if got is None else arnorm.plugin.Output(got.normed[:1], got.residual, got.quant)

        return wrong

    monkeypatch.setattr(B, "fast_path", bad_fast_path)
    with _op(backend="fastpath") as op:
        x, r, w = _inputs()
        with pytest.raises(
            arnorm.BackendBrokenError, match=r"^backend 'fastpath': .*Output\.normed: shape \[1, 32\]"
        ):
            op(x.clone(), r, w)
