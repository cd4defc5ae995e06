"""``AllReduceNorm(output_layout="in_place")``: the normed output over ``hidden_states`` and the new
residual over ``residual`` (vLLM's ``fused_add_rms_norm`` and FlashInfer's layout), bit for bit the
values of the default ``separate`` layout, for every backend that declares it; the others decline
with a reason. The conformance kit's in-place cases run in tests/test_conformance_reference.py and
the backends' own suites."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arnorm
from arnorm._problem import OUTPUT_LAYOUTS, Problem
from arnorm.op._args import build_problem
from arnorm.registry._capabilities import Capabilities, check_capabilities

H = 64
FORMATS = (None, "fp8_static", "fp8_per_token", "nvfp4", "mxfp8")


def _op(backend: str, quant: str | None = None, normed: bool = True, layout: str = "in_place",
        device: str = "cpu", max_tokens: int = 16, hidden: int = H) -> arnorm.AllReduceNorm:  # fmt: skip
    return arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=hidden, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), quant=quant,
        normed_output=normed, max_tokens=max_tokens, backend=backend, device=device, output_layout=layout,
    )  # fmt: skip


def _inputs(t: int, quant: str | None, device: str = "cpu", seed: int = 0, hidden: int = H):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).bfloat16().to(device)
    r = torch.randn(t, hidden, generator=g).bfloat16().to(device)
    w = (torch.randn(hidden, generator=g) * 0.2 + 1).bfloat16().to(device)
    scale = torch.tensor([0.05], device=device) if quant in ("fp8_static", "nvfp4") else None
    return x, r, w, scale


def _problem(**kw) -> Problem:
    args = dict(hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), quant=None, scale_layout=None,
                max_tokens=8, normed_output=True, inplace=True, device=torch.device("cpu"))  # fmt: skip
    return build_problem(1, **(args | kw))


# -- arguments, problem, capabilities -----------------------------------------------------------


def test_the_layout_is_a_problem_field_with_separate_the_default():
    assert OUTPUT_LAYOUTS == ("separate", "in_place")
    assert _problem().output_layout == "separate"
    p = _problem(output_layout="in_place")
    assert p.output_layout == "in_place" and " in-place " in p.short()
    assert "in-place" not in _problem().short()
    assert p != _problem() and hash(dataclasses.replace(p)) == hash(p)
    with pytest.raises(ValueError, match=r"output_layout: 'inplace' \(needs one of separate, in_place\)"):
        dataclasses.replace(p, output_layout="inplace")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"output_layout": "fused"}, r"output_layout: 'fused' \(needs 'separate' or 'in_place'\)"),
        (
            {"output_layout": "in_place", "inplace": False},
            r"output_layout: 'in_place' with inplace=False \(needs",
        ),
        (
            {"output_layout": "in_place", "add_residual": False},
            r"with add_residual=False \(needs add_residual=True",
        ),
    ],
)
def test_bad_layouts_are_refused_naming_the_argument(kw, message):
    with pytest.raises(arnorm.InvalidInputError, match=message):
        _problem(**kw)


def test_a_backend_not_declaring_the_layout_declines_in_the_grammar():
    caps = Capabilities(platforms=frozenset({"cpu"}))
    assert caps.output_layouts == frozenset({"separate"})
    assert check_capabilities(caps, _problem()) == ()
    assert check_capabilities(caps, _problem(output_layout="in_place")) == (
        "output layout: in_place (needs separate)",
    )
    both = Capabilities(platforms=frozenset({"cpu"}), output_layouts=frozenset(OUTPUT_LAYOUTS))
    assert check_capabilities(both, _problem(output_layout="in_place")) == ()
    with pytest.raises(ValueError, match="output_layouts: empty"):
        Capabilities(platforms=frozenset({"cpu"}), output_layouts=frozenset())


def test_declarations_of_the_shipped_backends():
    """reference, triton and flashinfer write the layout; triton_symm, aiter and the example do not
    (selection gives them the reason)."""
    declared = {i.name: i.spec.capabilities.output_layouts for i in arnorm.backends() if i.spec is not None}
    for name in ("reference", "triton", "flashinfer"):
        assert declared[name] == frozenset({"separate", "in_place"}), name
    for name in ("triton_symm", "aiter", "example"):
        if name in declared:
            assert declared[name] == frozenset({"separate"}), name


def test_auto_selection_explains_the_backends_that_decline():
    with _op(None) as op:
        text = str(op.explain())
    assert "in-place" in text
    assert "output layout: in_place (needs separate)" in text


# -- the call ---------------------------------------------------------------------------------


def _check_same(op_in, op_sep, t: int, quant: str | None, normed: bool, device: str = "cpu", seed: int = 0,
                hidden: int = H) -> None:  # fmt: skip
    x, r, w, scale = _inputs(t, quant, device, seed, hidden)
    want = op_sep(x.clone(), r.clone(), w, scale)
    xi, ri = x.clone(), r.clone()
    got = op_in(xi, ri, w, scale)
    assert got.residual is ri and torch.equal(ri, want.residual)
    if normed:
        assert got.normed is xi and torch.equal(xi, want.normed)
    else:
        assert got.normed is None
    if quant is not None:
        assert torch.equal(got.quant.data.view(torch.uint8), want.quant.data.view(torch.uint8))
        if want.quant.scale is not None:
            assert torch.equal(got.quant.scale.view(torch.uint8), want.quant.scale.view(torch.uint8))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("quant", "normed"), [(None, True), ("fp8_static", False), ("nvfp4", True)])
def test_values_are_the_separate_layouts_bit_for_bit(backend, quant, normed):
    with _op(backend, quant, normed) as op_in, _op(backend, quant, normed, "separate") as op_sep:
        for t in (1, 5):
            _check_same(op_in, op_sep, t, quant, normed, seed=t)


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 16), seed=st.integers(0, 2**16), quant=st.sampled_from(FORMATS), normed=st.booleans())
def test_reference_in_place_equals_separate(t, seed, quant, normed):
    if quant is None and not normed:
        normed = True
    with _op("reference", quant, normed) as op_in, _op("reference", quant, normed, "separate") as op_sep:
        _check_same(op_in, op_sep, t, quant, normed, seed=seed)


def test_strided_rows_are_written_in_place_and_nowhere_else():
    with _op("triton") as op_in, _op("triton", layout="separate") as op_sep:
        x, r, w, _ = _inputs(5, None)
        want = op_sep(x.clone(), r.clone(), w)
        xb = torch.full((5, H + 16), 3.5, dtype=torch.bfloat16)
        rb = torch.full((5, H + 8), -1.25, dtype=torch.bfloat16)
        xb[:, :H], rb[:, :H] = x, r
        got = op_in(xb[:, :H], rb[:, :H], w)
        assert torch.equal(xb[:, :H], want.normed) and torch.equal(rb[:, :H], want.residual)
        assert got.normed.data_ptr() == xb.data_ptr() and got.residual.data_ptr() == rb.data_ptr()
        assert (xb[:, H:] == 3.5).all() and (rb[:, H:] == -1.25).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_holds_the_quantized_output_only(backend):
    with _op(backend, "fp8_per_token") as op, _op(backend, "fp8_per_token", layout="separate") as sep:
        x, r, w, _ = _inputs(3, "fp8_per_token")
        out = op.empty_output(3)
        assert out.normed is None and out.residual is None and out.quant is not None
        want = sep(x.clone(), r.clone(), w)
        xi, ri = x.clone(), r.clone()
        got = op(xi, ri, w, out=out)
        assert got.quant.data is out.quant.data and got.quant.scale is out.quant.scale
        assert got.normed is xi and got.residual is ri
        assert torch.equal(out.quant.scale, want.quant.scale) and torch.equal(ri, want.residual)
        row = torch.empty(3, H, dtype=torch.bfloat16)
        with pytest.raises(arnorm.InvalidInputError, match=r"out.normed: Tensor \(needs None: .*'in_place'"):
            op(x.clone(), r.clone(), w, out=arnorm.Output(row, None, out.quant))
        with pytest.raises(arnorm.InvalidInputError, match=r"out.residual: Tensor \(needs None"):
            op(x.clone(), r.clone(), w, out=arnorm.Output(None, row, out.quant))


def test_a_leaf_residual_that_requires_grad_is_refused_before_the_write():
    with _op("reference") as op:
        x, r, w, _ = _inputs(2, None)
        r.requires_grad_(True)
        before = r.detach().clone()
        with pytest.raises(arnorm.InvalidInputError, match="residual: a leaf tensor that requires grad"):
            op(x, r, w)
        assert torch.equal(r.detach(), before)
        with torch.no_grad():
            op(x, r, w)
        assert not torch.equal(r.detach(), before)


def test_the_compiled_call_mutates_both_inputs():
    """torch.compile(fullgraph=True) traces the op through arnorm::all_reduce_norm_in_place, whose
    fake declares both inputs mutated: the compiled step sees the written tensors."""
    with _op("reference", "fp8_static", True) as op, _op("reference", "fp8_static", True, "separate") as sep:
        x, r, w, s = _inputs(4, "fp8_static")
        want = sep(x.clone(), r.clone(), w, s)

        def step(x, r, w, s):
            out = op(x, r, w, s)
            return out.normed * 2, out.residual + 0, out.quant.data.view(torch.uint8)

        xi, ri = x.clone(), r.clone()
        with torch.no_grad():
            doubled, residual, codes = torch.compile(step, fullgraph=True, backend="aot_eager")(xi, ri, w, s)
        assert torch.equal(xi, want.normed) and torch.equal(ri, want.residual)
        assert torch.equal(doubled, want.normed * 2) and torch.equal(residual, want.residual)
        assert torch.equal(codes, want.quant.data.view(torch.uint8))


# -- on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("quant", "normed", "hidden", "tokens"),
    [
        (None, True, 4096, (1, 7, 128, 2048)),  # T 2048 H 4096: a 16 MiB cell
        (None, True, 8192, (1, 1024)),  # T 1024 H 8192: the other
        ("fp8_static", False, 4096, (1, 33)),
        ("fp8_static", True, 4096, (1, 33)),
        ("fp8_per_token", False, 4096, (1, 33)),
        ("nvfp4", True, 4096, (1, 33, 129)),
        ("mxfp8", False, 4096, (1, 33)),
    ],
)
def test_gpu_triton_in_place_equals_separate(quant, normed, hidden, tokens):
    build = {"device": "cuda", "max_tokens": max(tokens), "hidden": hidden}
    with (
        _op("triton", quant, normed, **build) as op_in,
        _op("triton", quant, normed, "separate", **build) as op_sep,
    ):
        for t in tokens:
            _check_same(op_in, op_sep, t, quant, normed, "cuda", seed=t, hidden=hidden)


@pytest.mark.gpu
def test_gpu_triton_in_place_under_a_cuda_graph():
    with _op("triton", device="cuda", max_tokens=64, hidden=4096) as op, \
            _op("triton", layout="separate", device="cuda", max_tokens=64, hidden=4096) as sep:  # fmt: skip
        x, r, w, _ = _inputs(33, None, "cuda", hidden=4096)
        want = sep(x.clone(), r.clone(), w)
        xi, ri = x.clone(), r.clone()
        op(xi.clone(), ri.clone(), w)  # compiled and warm before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(xi, ri, w)
        xi.copy_(x)
        ri.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(xi, want.normed) and torch.equal(ri, want.residual)


def test_the_one_shot_form_takes_the_layout():
    x, r, w, _ = _inputs(3, None)
    want = arnorm.fused_allreduce_norm(x.clone(), r.clone(), w, group=arnorm.LOCAL, eps=1e-6)
    xi, ri = x.clone(), r.clone()
    got = arnorm.fused_allreduce_norm(xi, ri, w, group=arnorm.LOCAL, eps=1e-6, output_layout="in_place")
    assert got.normed is xi and got.residual is ri
    assert torch.equal(xi, want.normed) and torch.equal(ri, want.residual)
