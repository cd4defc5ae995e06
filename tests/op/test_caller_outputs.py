"""Caller-provided outputs: ``op(..., out=...)`` and ``op.empty_output(T)``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arnorm
from arnorm.op._results import CopyInto
from arnorm.testing import run_ranks

import ranks_fixtures as rf

H = 32
FORMATS = [
    (None, None),
    ("fp8_static", None),
    ("fp8_per_token", None),
    ("nvfp4", "swizzled_128x4"),
    ("nvfp4", "linear"),
    ("mxfp8", "linear"),
    ("mxfp8", "swizzled_128x4"),
]


def make(backend="reference", quant=None, layout=None, **kw) -> arnorm.AllReduceNorm:
    base = dict(hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), max_tokens=8)
    base.update(kw)
    return arnorm.AllReduceNorm(arnorm.LOCAL, backend=backend, quant=quant, scale_layout=layout, **base)


def inputs(t=5, quant=None):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g).bfloat16()
    r = torch.randn(t, H, generator=g).bfloat16()
    w = torch.randn(H, generator=g).bfloat16()
    s = torch.tensor([0.05]) if quant in ("fp8_static", "nvfp4") else None
    return x, r, w, s


def bits(t):
    return None if t is None else t.contiguous().view(torch.uint8)


def same(a: arnorm.Output, b: arnorm.Output) -> bool:
    pairs = [(a.normed, b.normed), (a.residual, b.residual)]
    if a.quant is not None:
        pairs += [(a.quant.data, b.quant.data), (a.quant.scale, b.quant.scale)]
    return all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(bits(u), bits(v)))
        for u, v in pairs
    )


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    ("quant", "layout", "normed"),
    # an op with neither a normed nor a quantized output is refused at construction
    [(q, lay, n) for q, lay in FORMATS for n in (True, False) if q is not None or n],
)
@pytest.mark.parametrize("inplace", [True, False])
def test_out_is_bitwise_the_allocating_call_and_holds_the_result(
    clean_env, backend, quant, layout, inplace, normed
):
    """Every format, in place or not, with and without normed: out= gives the same bits, in out's tensors."""
    with make(backend, quant, layout, inplace=inplace, normed_output=normed) as op:
        x, r, w, s = inputs(5, quant)
        expect = op(x.clone(), r, w, s)
        out = op.empty_output(5, s)
        for _ in range(2):  # the second call reuses the trusted out
            got = op(x.clone(), r, w, s, out=out)
            assert same(expect, got)
            assert got.normed is out.normed
            assert inplace or got.residual is out.residual
            if quant is not None:
                assert got.quant.data is out.quant.data
                assert got.quant.format == quant and got.quant.layout == expect.quant.layout
                assert got.quant.global_scale is expect.quant.global_scale
                if quant == "fp8_static":
                    assert got.quant.scale is s  # the call's scale, not out's
                else:
                    assert got.quant.scale is out.quant.scale


@pytest.mark.parametrize(("quant", "layout"), [f for f in FORMATS if f[0] is not None])
def test_empty_output_needs_no_scale(clean_env, quant, layout):
    """op.empty_output(T) without a scale works for every format (the scale an output records is the
    call's: out= ignores the field), and the call into it is bitwise the allocating call."""
    with make("reference", quant, layout) as op:
        x, r, w, s = inputs(5, quant)
        assert same(op(x.clone(), r, w, s), op(x.clone(), r, w, s, out=op.empty_output(5)))


def test_triton_writes_in_place_and_others_are_copied_into(clean_env):
    """triton declares caller_outputs and writes out directly; the reference goes through CopyInto."""
    with make("triton") as op:
        assert not isinstance(op._plan.into_table[1], CopyInto)
    with make("reference") as op:
        assert isinstance(op._plan.into_table[1], CopyInto)
    assert arnorm.plugin.Capabilities(platforms=frozenset({"cpu"})).caller_outputs is False


def test_without_residual_takes_out(clean_env):
    """add_residual=False ops take out= too, bitwise the allocating call."""
    with make("triton", "fp8_per_token", add_residual=False) as op:
        x, _, w, s = inputs(3, "fp8_per_token")
        expect = op(x.clone(), None, w, s)
        got = op(x.clone(), None, w, s, out=op.empty_output(3))
        assert same(expect, got)


def _rejects(op, out, match, t=5, quant=None):
    x, r, w, s = inputs(t, quant)
    with pytest.raises(arnorm.InvalidInputError, match=match):
        op(x, r, w, s, out=out)
    # Nothing was left behind: the next call works and x was not written by the rejected one.
    x2, r2, w2, s2 = inputs(t, quant)
    assert torch.equal(x, x2)
    op(x2, r2, w2, s2)


def test_bad_out_is_rejected_with_the_argument_named(clean_env):
    """Wrong type, tokens, dtype, layout, alignment, field, format: one message each, in the grammar."""
    with make(quant="fp8_per_token") as op:
        good = op.empty_output(5)
        _rejects(op, (good.normed,), r"^out: tuple \(needs an arnorm.Output, e.g. op.empty_output\(5\)\)$")
        _rejects(op, op.empty_output(4), r"^out.normed: shape \[4, 32\] \(needs \[5, 32\] for 5 tokens\)$")
        wrong = good._replace(normed=good.normed.float())
        _rejects(op, wrong, r"^out.normed: dtype torch.float32 \(needs torch.bfloat16\)$")
        strided = good._replace(normed=torch.empty(32, 5, dtype=torch.bfloat16).t())
        _rejects(op, strided, r"^out.normed: non-contiguous, strides \[1, 5\] \(needs .contiguous\(\)\)$")
        buf = torch.empty(5 * 32 + 8, dtype=torch.bfloat16)
        _rejects(
            op, good._replace(normed=buf[1:161].view(5, 32)), r"^out.normed: data pointer .* \(needs 16-byte"
        )
        scales = good.quant._replace(scale=torch.empty(5, 2))
        _rejects(op, good._replace(quant=scales), r"^out.quant.scale: shape \[5, 2\] \(needs \[5, 1\]")
        other = good.quant._replace(format="mxfp8")
        _rejects(op, good._replace(quant=other), r"^out.quant.format: 'mxfp8' \(needs 'fp8_per_token'")
        _rejects(op, good._replace(quant=None), r"^out.quant: NoneType \(needs an arnorm.QuantizedActivation")
        grad = good._replace(normed=torch.zeros(5, 32, dtype=torch.bfloat16, requires_grad=True))
        _rejects(op, grad, r"^out.normed: requires grad \(needs a buffer without autograd history")
    with make(normed_output=False, quant="fp8_static") as op:
        s = torch.tensor([0.05])
        out = op.empty_output(5, s)._replace(normed=torch.empty(5, 32, dtype=torch.bfloat16))
        match = r"^out.normed: Tensor \(needs None: the op was built with normed_output=False\)$"
        _rejects(op, out, match, quant="fp8_static")
    with make() as op:
        q = arnorm.quant.empty_quantized("fp8_per_token", 5, 32, device="cpu")
        _rejects(op, op.empty_output(5)._replace(quant=q), r"^out.quant: QuantizedActivation \(needs None")


def test_destinations_may_not_overlap_each_other(clean_env):
    """Two destinations sharing bytes are rejected: the kernel would write one over the other."""
    with make(quant="fp8_per_token", inplace=False) as op:
        out = op.empty_output(5)
        _rejects(
            op,
            out._replace(residual=out.normed),
            r"^out.residual: overlaps out.normed \(needs a separate buffer\)$",
        )


@settings(max_examples=60, deadline=None)
@given(
    target=st.sampled_from(["hidden_states", "residual", "weight"]),
    offset=st.integers(min_value=-120, max_value=120),
)
def test_out_overlapping_an_input_is_rejected_exactly_when_bytes_are_shared(target, offset):
    """out.normed placed anywhere around an input in one buffer: rejected iff their byte ranges meet."""
    t = 2
    base = torch.zeros(4096, dtype=torch.bfloat16)
    at = 1024  # the input's element offset in base
    size = {"hidden_states": t * H, "residual": t * H, "weight": H}[target]
    start = at + offset * 8  # multiples of 8 elements keep 16-byte alignment
    with make() as op:
        x, r, w, _ = inputs(t)
        placed = base[at : at + size]
        if target == "weight":
            w = placed.copy_(w)
        elif target == "residual":
            r = placed.view(t, H).copy_(r)
        else:
            x = placed.view(t, H).copy_(x)
        out = arnorm.Output(base[start : start + t * H].view(t, H), None, None)  # type: ignore[arg-type]
        overlaps = start < at + size and at < start + t * H
        if overlaps:
            with pytest.raises(
                arnorm.InvalidInputError, match=rf"^out.normed: overlaps {target} \(needs a separate"
            ):
                op(x, r, w, out=out)
        else:
            op(x, r, w, out=out)


@settings(max_examples=80, deadline=None)
@given(
    target=st.sampled_from(["hidden_states", "residual", "weight", "scale"]),
    offset=st.integers(min_value=-40, max_value=40),
    add_residual=st.booleans(),
)
def test_a_trusted_out_meeting_a_later_input_is_rejected_exactly_when_bytes_are_shared(
    target, offset, add_residual
):
    """out trusted by a good call, then an input placed around out.normed: rejected iff bytes meet
    (the call's inline test of a trusted out, with and without a residual)."""
    if target == "residual" and not add_residual:
        target = "hidden_states"
    t = 2
    base = torch.zeros(4096, dtype=torch.bfloat16)
    at = 1024  # out.normed's element offset in base
    with make(quant="fp8_static", add_residual=add_residual) as op:
        x, r, w, s = inputs(t, "fp8_static")
        r = r if add_residual else None
        out = op.empty_output(t, s)
        out = arnorm.Output(base[at : at + t * H].view(t, H), None, out.quant)  # type: ignore[arg-type]
        op(x.clone(), r, w, s, out=out)  # trusted from here on
        start = at + offset * 8  # multiples of 8 elements keep 16-byte alignment
        size = {"hidden_states": t * H, "residual": t * H, "weight": H, "scale": 2}[target]
        placed = base[start : start + size]
        if target == "weight":
            w = placed.copy_(w)
        elif target == "residual":
            r = placed.view(t, H).copy_(r)
        elif target == "scale":
            s = placed.view(torch.float32).copy_(s)
        else:
            x = placed.view(t, H).copy_(x)
        if start < at + t * H and at < start + size:
            with pytest.raises(
                arnorm.InvalidInputError, match=rf"^out.normed: overlaps {target} \(needs a separate"
            ):
                op(x, r, w, s, out=out)
        else:
            op(x, r, w, s, out=out)


def test_a_data_swap_on_a_trusted_out_is_checked_again(clean_env):
    """out.normed.data = hidden_states after a good call: the pointer changed, so the overlap is caught."""
    with make("triton") as op:
        x, r, w, _ = inputs(5)
        out = op.empty_output(5)
        op(x.clone(), r, w, out=out)
        x2 = x.clone()
        out.normed.data = x2
        with pytest.raises(arnorm.InvalidInputError, match=r"^out.normed: overlaps hidden_states"):
            op(x2, r, w, out=out)


def test_empty_output_shapes_follow_the_format_table(clean_env):
    """empty_output(T): normed, residual (None in place) and quant shaped as empty_quantized makes them."""
    with make(quant="nvfp4", layout="swizzled_128x4", inplace=False) as op:
        out = op.empty_output(3, torch.tensor([0.05]))
        assert out.normed.shape == (3, H) and out.residual.shape == (3, H)
        assert out.quant.data.shape == (3, H // 2) and out.quant.scale.shape == (128, 4)
        assert out.quant.format == "nvfp4" and out.quant.layout == "swizzled_128x4"
    with make() as op:
        assert op.empty_output(2).residual is None
        with pytest.raises(arnorm.InvalidInputError, match=r"^num_tokens: 9 \(needs an int from 1 to 8\)$"):
            op.empty_output(9)
    op.close()
    with pytest.raises(arnorm.InvalidInputError, match="op: closed"):
        op.empty_output(2)


def test_backward_through_out_says_inference_only(clean_env):
    """With autograd recording, out= still returns the values, and a backward raises InferenceOnlyError."""
    with make(inplace=False) as op:
        x, r, w, _ = inputs(3)
        w = w.clone().requires_grad_()
        got = op(x, r, w, out=op.empty_output(3))
        with pytest.raises(arnorm.InferenceOnlyError, match="inference only"):
            got.normed.float().sum().backward()


def test_compiled_call_with_out_writes_into_out(clean_env):
    """torch.compile(fullgraph=True): out= is honoured (the custom op's result copied into out)."""
    with make(inplace=False) as op:
        x, r, w, _ = inputs(4)
        out = op.empty_output(4)
        expect = op(x.clone(), r, w)

        def step(x, r, w, out):
            got = op(x, r, w, out=out)
            return got.normed, got.residual

        normed, _ = torch.compile(step, fullgraph=True, backend="aot_eager")(x.clone(), r, w, out)
        assert torch.equal(normed, expect.normed) and torch.equal(out.normed, expect.normed)
        assert torch.equal(out.residual, expect.residual)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_call_rejects_a_bad_out(clean_env, fullgraph):
    """torch.compile: an out whose dtype is wrong raises with arnorm's message instead of casting
    into it (fullgraph=True wraps it in Dynamo's error; the message is arnorm's)."""
    with make(inplace=False) as op:
        x, r, w, _ = inputs(4)
        bad = op.empty_output(4)._replace(normed=torch.empty(4, H))

        def step(x, r, w, out):
            return op(x, r, w, out=out).normed

        with pytest.raises(
            Exception, match=r"out.normed: dtype torch.float32 \(needs torch.bfloat16\)"
        ) as info:
            torch.compile(step, fullgraph=fullgraph, backend="aot_eager")(x.clone(), r, w, bad)
        assert fullgraph or isinstance(info.value, arnorm.InvalidInputError)


@pytest.mark.parametrize(("world", "backend"), [(2, "reference"), (2, "triton"), (4, "triton")])
def test_out_at_tp(world, backend):
    """At TP 2 and 4, out= is bitwise the allocating call; a bad out on one rank is rejected on all
    (ARNORM_CHECK_CALLS) and the next call still pairs up."""
    results = run_ranks(world, rf.caller_outputs, backend)
    for rank_results in results:
        *formats, (message, ok) = rank_results
        assert all(s and is_out for _, s, is_out in formats), formats
        assert (
            message.startswith("calls: differ across ranks or were rejected")
            and "out.normed: shape" in message
        )
        assert ok
