"""Ops built with add_residual=False: all-reduce + norm (+ quant) with no residual read or added."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arnorm
from arnorm._reference import add_rmsnorm
from arnorm.op._results import ZeroResidual
from arnorm.plugin import Capabilities
from arnorm.testing import run_ranks

import fake_backends
import ranks_fixtures as rf

H = 16
NATIVE_REFERENCE = dataclasses.replace(
    fake_backends.REFERENCE,
    capabilities=fake_backends.REFERENCE.capabilities.model_copy(update={"residual_free": True}),
)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def make(**kw) -> arnorm.AllReduceNorm:
    base = dict(hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6, 1.0), max_tokens=8)
    base.update(kw)
    return arnorm.AllReduceNorm(arnorm.LOCAL, add_residual=False, **base)


def partial(tokens: int = 5) -> torch.Tensor:
    x = torch.randn(tokens, H).bfloat16()
    x[0, :3] = -0.0  # kept negative by a residual-free op; a +0.0 residual would flip it
    return x


def native_reference(*specs) -> None:
    """The registry: a reference that serves residual=None itself, plus ``specs``."""
    from arnorm.registry._discovery import Registry, reset_registry

    reg = Registry()
    reg.add(NATIVE_REFERENCE, plugin="arnorm")
    for s in specs:
        reg.add(s, plugin="tests")
    reset_registry(reg)


@pytest.mark.parametrize("quant", [None, "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("inplace", [True, False])
def test_the_reference_without_residual_is_the_norm_of_the_sum_bitwise(clean_env, quant, inplace):
    """residual=None: Output.residual is the sum itself (-0.0 kept) and normed its norm, every format."""
    native_reference()
    h = 32 if quant in ("nvfp4", "mxfp8") else H
    x = torch.randn(5, h).bfloat16()
    x[0, :3] = -0.0
    w = torch.randn(h).bfloat16()
    scale = torch.tensor([0.5]) if quant in ("fp8_static", "nvfp4") else None
    with make(hidden_size=h, quant=quant, inplace=inplace) as op:
        assert op.problem.add_residual is False and "no-residual" in op.problem.short()
        before = x.clone()
        out = op(x, None, w, scale)
    expect_h, expect_y = add_rmsnorm(before, None, w, 1e-6, 1.0)
    assert torch.equal(bits(out.residual), bits(expect_h)) and torch.equal(bits(out.normed), bits(expect_y))
    assert (out.residual.data_ptr() == x.data_ptr()) == inplace
    if not inplace:
        assert torch.equal(bits(x), bits(before))


def test_a_backend_without_residual_free_reads_negative_zeros_and_matches_bitwise(clean_env):
    """A backend that does not declare residual_free gets T rows of -0.0; the result is the same bits."""
    seen = []

    class Recording(fake_backends.SmallBackend):
        def __call__(self, hidden_states, residual, weight, scale):
            seen.append(residual.clone())
            return super().__call__(hidden_states, residual, weight, scale)

    fake_backends.Recording = Recording
    native_reference(fake_backends.spec("small", 60, "Recording"))
    w = torch.randn(H).bfloat16()
    with make() as op:
        served = list(op._plan.table)
        assert isinstance(served[3], ZeroResidual) and not isinstance(served[8], ZeroResidual)
        assert served[1]._zeros.shape == (4, H)  # as many rows as the wrapped backend serves
        assert op.backend_for(3) == "small" and op.backend_for(8) == "reference"
        assert "no residual: small read rows of a -0.0 buffer as the residual (needs" in str(op.explain())
        for t in (3, 8):
            x = partial(t)
            before = x.clone()
            out = op(x, None, w)
            expect_h, expect_y = add_rmsnorm(before, None, w, 1e-6, 1.0)
            assert torch.equal(bits(out.residual), bits(expect_h)), t
            assert torch.equal(bits(out.normed), bits(expect_y)), t
    assert len(seen) == 1 and seen[0].shape == (3, H)
    assert torch.equal(bits(seen[0]), torch.full((3, H), -0.0).bfloat16().view(torch.int16))


def test_an_op_whose_backends_all_serve_it_allocates_no_zero_buffer(clean_env):
    """Every backend residual_free: nothing is wrapped, nothing allocated."""
    native_reference()
    with make() as op:
        assert not any(isinstance(i, ZeroResidual) for i in op._chain)


def test_residual_none_and_a_residual_tensor_are_each_rejected_on_the_other_kind_of_op(clean_env):
    """The op's kind decides: None needs add_residual=False, a tensor needs the default."""
    fake_backends.install()
    x, w = partial(), torch.randn(H).bfloat16()
    with (
        make() as op,
        pytest.raises(arnorm.InvalidInputError, match=r"residual: Tensor \(needs None: the op"),
    ):
        op(x, torch.zeros_like(x), w)
    with (
        arnorm.AllReduceNorm(arnorm.LOCAL, hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm()) as op,
        pytest.raises(
            arnorm.InvalidInputError,
            match=r"residual: None \(needs a \[tokens, 16\] tensor; .*add_residual=False",
        ),
    ):
        op(x, None, w)


def test_add_residual_must_be_a_bool(clean_env):
    """add_residual=1 is rejected, naming the argument."""
    fake_backends.install()
    with pytest.raises(arnorm.InvalidInputError, match=r"add_residual: 1 \(needs True or False\)"):
        arnorm.AllReduceNorm(
            arnorm.LOCAL, hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(), add_residual=1
        )


def test_fused_allreduce_norm_with_residual_none_builds_a_residual_free_op(clean_env):
    """The one-shot helper keys its cache on residual being None and gives the contract's bits."""
    native_reference()
    x, w = partial(), torch.randn(H).bfloat16()
    before = x.clone()
    out = arnorm.fused_allreduce_norm(x, None, w, group=arnorm.LOCAL, eps=1e-6, weight_offset=1.0)
    expect_h, expect_y = add_rmsnorm(before, None, w, 1e-6, 1.0)
    assert torch.equal(bits(out.residual), bits(expect_h)) and torch.equal(bits(out.normed), bits(expect_y))
    r = torch.randn(5, H).bfloat16()
    out2 = arnorm.fused_allreduce_norm(before.clone(), r, w, group=arnorm.LOCAL, eps=1e-6, weight_offset=1.0)
    assert torch.equal(out2.residual, add_rmsnorm(before, r, w, 1e-6, 1.0)[0])


def test_a_compiled_call_without_residual_matches_eager(clean_env):
    """torch.compile(fullgraph=True) traces residual=None through the custom op."""
    native_reference()
    x, w = partial(), torch.randn(H).bfloat16()
    with make() as op:

        def step(x, w):
            out = op(x, None, w)
            return out.normed * 2, out.residual

        expect_h, expect_y = add_rmsnorm(x.clone(), None, w, 1e-6, 1.0)
        y2, h = torch.compile(step, fullgraph=True, backend="aot_eager")(x, w)
    assert torch.equal(bits(h), bits(expect_h)) and torch.equal(y2, expect_y * 2)


def test_backward_through_a_call_without_residual_says_inference_only(clean_env):
    """With grad recording, the outputs' backward raises InferenceOnlyError (no residual involved)."""
    native_reference()
    w = torch.randn(H).bfloat16().requires_grad_()
    with make() as op:
        out = op(partial(), None, w)
        with pytest.raises(arnorm.InferenceOnlyError):
            out.normed.float().sum().backward()


KINDS = st.sampled_from(
    ["ok", "residual_tensor", "dtype", "shape", "too_many", "strided", "transposed", "meta", "w_in_x",
     "w_dtype", "w_none", "not_tensor", "leaf_grad"]
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(kind=KINDS, warm=st.booleans(), inplace=st.booleans())
def test_the_fast_path_without_residual_accepts_exactly_what_check_call_accepts(kind, warm, inplace):
    """For residual=None calls, the inline predicate and check_call agree, and only rejects go slow."""
    import arnorm.op._call as op_module
    from arnorm.op._call import check_call

    fake_backends.install()
    slow: list[bool] = []
    real = op_module.check_call
    x, w = torch.randn(4, H).bfloat16(), torch.randn(H).bfloat16()
    table = {
        "ok": (x, None, w, None),
        "residual_tensor": (x, x.clone(), w, None),
        "dtype": (x.float(), None, w, None),
        "shape": (x[:, :4].contiguous(), None, w, None),
        "too_many": (torch.randn(9, H).bfloat16(), None, w, None),
        "strided": (torch.randn(4, 2 * H).bfloat16()[:, :H], None, w, None),
        "transposed": (torch.randn(H, 4).bfloat16().t(), None, w, None),
        "meta": (torch.empty(4, H, dtype=torch.bfloat16, device="meta"), None, w, None),
        "w_in_x": (x, None, x[0], None),
        "w_dtype": (x, None, w.float(), None),
        "w_none": (x, None, None, None),
        "not_tensor": (x.tolist(), None, w, None),
        "leaf_grad": (torch.randn(4, H).bfloat16().requires_grad_(), None, w, None),
    }
    op_module.check_call = lambda *a: (slow.append(True), real(*a))[1]
    try:
        with make(inplace=inplace) as op:
            if warm:
                op(x.clone(), None, w)
                slow.clear()
            args = table[kind]
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
    finally:
        op_module.check_call = real
    assert call_ok == check_ok, kind
    assert (not slow) == check_ok, kind


@pytest.mark.parametrize(("world", "backend", "wrapped"), [(2, "reference", False), (4, "reference", False),
                                                           (2, "example", True)])  # fmt: skip
def test_ranks_without_residual_match_the_rank_order_sum_bitwise(world, backend, wrapped):
    """On 2 and 4 gloo ranks the reference (native) and the example plugin (through the -0.0
    buffer: it does not declare residual_free) give the contract's bits on every rank."""
    if backend == "example" and backend not in {b.name for b in arnorm.backends() if b.is_available}:
        pytest.skip("the arnorm-example plugin is not installed")
    results = run_ranks(world, rf.without_residual, backend)
    assert results == [(backend, True, True, wrapped)] * world


def test_capabilities_default_to_not_residual_free():
    """A backend that says nothing about residual_free is served through the -0.0 buffer."""
    assert Capabilities(platforms=frozenset({"cpu"})).residual_free is False
