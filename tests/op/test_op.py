"""AllReduceNorm on one process: selection, validation, dispatch, lifetime, torch.compile."""

from __future__ import annotations

import re

import pytest
import torch

import arnorm
from arnorm._reference import add_rmsnorm

import fake_backends

H = 32


def inputs(t=4, h=H, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, h, generator=g).to(dtype),
        torch.randn(t, h, generator=g).to(dtype),
        torch.randn(h, generator=g).to(dtype),
    )


@pytest.fixture(autouse=True)
def _reference_only():
    """The core's own behaviour is checked against the reference alone (no plugin, no interpreter)."""
    fake_backends.install()


def make(group=arnorm.LOCAL, **kw) -> arnorm.AllReduceNorm:
    base = dict(hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=16)
    base.update(kw)
    return arnorm.AllReduceNorm(group, **base)


def test_tp1_reference_matches_contract_and_writes_in_place(clean_env):
    """At TP 1 the residual is x + residual (no collective), written into hidden_states."""
    x, r, w = inputs(dtype=torch.bfloat16)
    expect_h, expect_y = add_rmsnorm(x.clone(), r, w, 1e-6, 1.0)
    with make(dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6, 1.0)) as op:
        out = op(x, r, w)
    assert out.residual is x and torch.equal(x, expect_h) and torch.equal(out.normed, expect_y)
    assert out.quant is None


def test_not_inplace_leaves_inputs_alone(clean_env):
    """inplace=False returns a new residual and leaves hidden_states untouched."""
    x, r, w = inputs()
    x0 = x.clone()
    with make(inplace=False) as op:
        out = op(x, r, w)
    assert out.residual is not x and torch.equal(x, x0)


def test_auto_picks_highest_priority_and_explains(clean_env):
    """Auto mode takes the highest-priority eligible backend; explain lists every verdict."""
    fake_backends.install(
        fake_backends.spec("fast", 50, "AllReduceBackend"),
        fake_backends.spec("picky", 90, "ProbeRejectsBackend"),
        fake_backends.spec("gpuonly", 95, "AllReduceBackend", caps=arnorm.Capabilities(platforms={"cuda"})),
    )
    with make() as op:
        text = str(op.explain())
        assert op.backend == "fast"
        assert [v.backend for v in op.explain().verdicts] == ["gpuonly", "picky", "fast", "reference"]
    assert re.search(r"gpuonly\s+95\s+incompatible\s+platform: cpu \(needs cuda\)", text)
    assert re.search(
        r"picky\s+90\s+incompatible\s+topology: no NVLink \(needs P2P access between the GPUs\)", text
    )
    # Selection is lazy: nothing below the chosen backend that serves every count is probed.
    assert re.search(r"fast\s+50\s+selected", text)
    assert re.search(r"reference\s+0\s+unprobed\s+not probed: fast serves every token count", text)


def test_priority_tie_breaks_by_name(clean_env):
    """Equal priorities are ordered by name."""
    fake_backends.install(
        fake_backends.spec("zeta", 10, "AllReduceBackend"),
        fake_backends.spec("alpha", 10, "AllReduceBackend"),
    )
    with make() as op:
        assert op.backend == "alpha"


def test_disable_removes_from_auto_only(clean_env):
    """ARNORM_DISABLE skips a backend in auto mode but a strict request still gets it."""
    fake_backends.install(fake_backends.spec("fast", 50, "AllReduceBackend"))
    clean_env.setenv("ARNORM_DISABLE", "fast")
    with make() as op:
        assert op.backend == "reference"
        assert "disabled: listed in ARNORM_DISABLE" in op.explain().rejections()["fast"][0]
    with make(backend="fast") as op:
        assert op.backend == "fast"


def test_env_backend_is_strict_and_argument_wins(clean_env):
    """ARNORM_BACKEND forces a backend; the backend= argument overrides it."""
    fake_backends.install(fake_backends.spec("fast", 50, "AllReduceBackend"))
    clean_env.setenv("ARNORM_BACKEND", "reference")
    with make() as op:
        assert op.backend == "reference" and op.explain().source == "ARNORM_BACKEND"
    with make(backend="fast") as op:
        assert op.backend == "fast" and op.explain().source == "argument"
    with make(config=arnorm.Config(backend="fast")) as op:
        assert op.backend == "fast" and op.explain().source == "Config.backend"


def test_strict_errors_name_the_backend_and_reasons(clean_env):
    """A named backend that cannot serve raises with its reasons; the error types differ by cause."""
    fake_backends.install(
        fake_backends.spec("picky", 90, "ProbeRejectsBackend"),
        fake_backends.spec("gone", 80, "AllReduceBackend", requires=("no_such_module_xyz",), extra="gone"),
    )
    with pytest.raises(
        arnorm.NoEligibleBackendError, match=r"(?s)backend .picky. \(from argument\).*topology: no NVLink"
    ):
        make(backend="picky")
    with pytest.raises(arnorm.BackendNotInstalledError, match=r"pip install 'arnorm\[gone\]'"):
        make(backend="gone")
    with pytest.raises(
        arnorm.BackendNotInstalledError, match=r"registry: no backend named 'nope' \(needs one of"
    ) as info:
        make(backend="nope")
    assert info.value.explanation.verdict("nope").status == "unknown"


@pytest.mark.parametrize("source", ["argument", "Config.backend", "ARNORM_BACKEND"])
def test_a_misspelt_backend_name_says_did_you_mean(clean_env, source):
    """'refrence' from any source: BackendNotInstalledError with the close registered name."""
    kw: dict = {}
    if source == "argument":
        kw["backend"] = "refrence"
    elif source == "Config.backend":
        kw["config"] = arnorm.Config(backend="refrence")
    else:
        clean_env.setenv("ARNORM_BACKEND", "refrence")
    with pytest.raises(arnorm.BackendNotInstalledError) as info:
        make(**kw)
    (reason,) = info.value.explanation.verdict("refrence").reasons
    assert re.fullmatch(
        r"registry: no backend named 'refrence' \(needs one of .*; did you mean 'reference'\?\)", reason
    )
    assert f"(from {source})" in str(info.value)


def test_a_misspelt_disabled_name_warns_did_you_mean(clean_env):
    clean_env.setenv("ARNORM_DISABLE", "refrence")
    with pytest.warns(
        arnorm.ArnormWarning, match=r"'refrence' is not a registered backend .*did you mean 'reference'\?\)$"
    ):
        make().close()


def test_a_name_close_to_nothing_gets_no_guess(clean_env):
    with pytest.raises(arnorm.BackendNotInstalledError) as info:
        make(backend="zzzzzz")
    assert "did you mean" not in str(info.value)


def test_probe_that_raises_becomes_a_reason(clean_env, monkeypatch):
    """A probe raising an exception rejects its backend instead of breaking selection."""
    fake_backends.install(fake_backends.spec("fast", 50, "AllReduceBackend"))

    def boom(cls, problem):
        raise OSError("driver not loaded")

    monkeypatch.setattr(fake_backends.AllReduceBackend, "probe", classmethod(boom))
    with make() as op:
        assert op.backend == "reference"
        assert op.explain().rejections()["fast"] == (
            "probe: raised OSError: driver not loaded (needs a probe that returns reasons)",
        )


def test_token_budget_falls_back_per_call(clean_env):
    """A backend with a token budget serves small calls; larger ones go to the next in the chain."""
    fake_backends.install(fake_backends.spec("small", 60, "SmallBackend"))
    with make() as op:
        assert op.explain().chain == ("small", "reference")
        assert op.backend_for(4) == "small" and op.backend_for(5) == "reference"
        e = op.explain(num_tokens=5)
        assert e.token_backend == "reference"
        assert e.token_reasons == (("small", ("tokens: 5 (needs <= 4, the workspace budget)",)),)
        x, r, w = inputs(t=5)
        expect = add_rmsnorm(x.clone(), r, w, 1e-6, 0.0)[1]
        assert torch.equal(op(x, r, w).normed, expect)


def test_strict_token_budget_raises_at_call(clean_env):
    """A strictly named backend that cannot serve a token count raises, naming the budget."""
    fake_backends.install(fake_backends.spec("small", 60, "SmallBackend"))
    with make(backend="small") as op:
        x, r, w = inputs(t=5)
        with pytest.raises(
            arnorm.NoEligibleBackendError,
            match=r"tokens: 5 \(needs a token count some backend of this op serves",
        ):
            op(x, r, w)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda x, r, w, s: (x[:, :16].contiguous(), r, w, s),
            r"hidden_states: shape \[4, 16\] \(needs \[tokens, 32\]",
        ),
        (
            lambda x, r, w, s: (x.double(), r, w, s),
            r"hidden_states: dtype torch.float64 \(needs torch.float32",
        ),
        (lambda x, r, w, s: (x, r.half(), w, s), r"residual: dtype torch.float16 \(needs torch.float32"),
        (lambda x, r, w, s: (x, r, w.bfloat16(), s), r"weight: dtype torch.bfloat16 \(needs torch.float32"),
        (lambda x, r, w, s: (x, r[:2], w, s), r"residual: shape \[2, 32\] \(needs \[4, 32\]"),
        (lambda x, r, w, s: (x, r, w[:8], s), r"weight: shape \[8\] \(needs \[32\]\)"),
        (lambda x, r, w, s: (torch.randn(32, 4).t(), r, w, s), r"hidden_states: non-contiguous"),
        (
            lambda x, r, w, s: (torch.randn(17, 32), torch.randn(17, 32), w, s),
            r"hidden_states: 17 tokens \(needs 1 to 16",
        ),
        (
            lambda x, r, w, s: (x, x, w, s),
            r"residual: overlaps hidden_states' memory \(needs a separate buffer",
        ),
        (lambda x, r, w, s: (x, x.view(4, 32), w, s), r"residual: overlaps hidden_states' memory"),
        (
            lambda x, r, w, s: (x, r, w, torch.ones(1)),
            r"scale: Tensor \(needs None: quant=None takes no input scale",
        ),
        (lambda x, r, w, s: (x.tolist(), r, w, s), r"hidden_states: list \(needs a torch.Tensor\)"),
    ],
)
def test_bad_input_is_rejected_and_leaves_no_state(clean_env, mutate, message):
    """Each bad argument raises naming itself; the op then serves a valid call unchanged."""
    x, r, w = inputs()
    with make() as op:
        plan = op._plan
        with pytest.raises(arnorm.InvalidInputError, match=message):
            op(*mutate(x, r, w, None))
        assert op._plan is plan
        expect = add_rmsnorm(x.clone(), r, w, 1e-6, 0.0)[0]
        assert torch.equal(op(x, r, w).residual, expect)


def test_bad_constructor_arguments_name_themselves(clean_env):
    """Constructor arguments are checked before anything collective happens."""
    cases = {
        r"hidden_size: 0 \(needs a positive int\)": dict(hidden_size=0),
        r"dtype: torch.float64 \(needs torch.bfloat16": dict(dtype=torch.float64),
        r"norm: float \(needs arnorm.RMSNorm": dict(norm=1e-6),
        r"max_tokens: -1 \(needs a positive int\)": dict(max_tokens=-1),
        r"inplace: 'yes' \(needs True or False\)": dict(inplace="yes"),
        r"normed_output: False with quant=None": dict(normed_output=False),
        r"scale_layout: 'linear' \(needs None when quant is None\)": dict(scale_layout="linear"),
    }
    for message, kw in cases.items():
        with pytest.raises(arnorm.InvalidInputError, match=message):
            make(**kw)


def test_close_is_idempotent_and_final(clean_env):
    """close() releases every backend once; later calls fail clearly."""
    fake_backends.AllReduceBackend.closed.clear()
    fake_backends.install(fake_backends.spec("small", 60, "SmallBackend"))
    op = make()
    op.close()
    op.close()
    assert fake_backends.AllReduceBackend.closed == ["small"]
    x, r, w = inputs()
    with pytest.raises(arnorm.InvalidInputError, match=r"op: closed"):
        op(x, r, w)


def test_backend_for_validates_its_argument(clean_env):
    """backend_for() and explain() take a token count within the budget."""
    with (
        make() as op,
        pytest.raises(arnorm.InvalidInputError, match=r"num_tokens: 0 \(needs an int from 1 to 16\)"),
    ):
        op.backend_for(0)


def test_fused_allreduce_norm_caches_and_grows(clean_env):
    """The functional form reuses one op per signature and rebuilds for a larger token count."""
    from arnorm.op._oneshot import _cache

    fake_backends.install()  # the reference only: no 9,000-token run through the Triton interpreter
    _cache.clear()
    x, r, w = inputs()
    out = arnorm.fused_allreduce_norm(x, r, w, group=arnorm.LOCAL, eps=1e-5)
    op = next(iter(_cache.values()))
    arnorm.fused_allreduce_norm(*inputs(seed=1), group=arnorm.LOCAL, eps=1e-5)
    assert next(iter(_cache.values())) is op
    big = inputs(t=9000)
    arnorm.fused_allreduce_norm(*big, group=arnorm.LOCAL, eps=1e-5)
    assert next(iter(_cache.values())).problem.max_tokens == 16384 and op._closed
    assert out.normed is not None
    _cache.clear()


def test_fused_allreduce_norm_keeps_at_most_cache_size_ops_and_closes_the_oldest(clean_env):
    """Past CACHE_SIZE signatures the least recently used op is closed and dropped."""
    from arnorm.op._oneshot import CACHE_SIZE, _cache

    fake_backends.install()
    _cache.clear()
    x, r, w = inputs()
    for i in range(CACHE_SIZE):
        arnorm.fused_allreduce_norm(x.clone(), r, w, group=arnorm.LOCAL, eps=1e-6 * (i + 1))
    first = next(iter(_cache.values()))
    arnorm.fused_allreduce_norm(x.clone(), r, w, group=arnorm.LOCAL, eps=1.0)
    assert len(_cache) == CACHE_SIZE and first._closed and first not in _cache.values()
    _cache.clear()


def test_fused_allreduce_norm_needs_a_group(clean_env):
    """group= is required: None is not silently WORLD."""
    x, r, w = inputs()
    with pytest.raises(
        arnorm.InvalidInputError, match=r"tp_group: None, and torch.distributed is not initialized"
    ):
        arnorm.fused_allreduce_norm(x, r, w, group=None, eps=1e-6)


@pytest.mark.parametrize(
    ("hidden", "message"),
    [
        (lambda x: x[0], r"^hidden_states: shape \[32\] \(needs a 2-D torch.Tensor \[tokens, hidden\]\)$"),
        (lambda x: x.tolist(), r"^hidden_states: list \(needs a 2-D torch.Tensor"),
        (lambda x: x.int(), r"^hidden_states: dtype torch.int32 \(needs torch.bfloat16, torch.float16 or "),
    ],
)
def test_fused_allreduce_norm_names_hidden_states(clean_env, hidden, message):
    """The one-shot form blames hidden_states (its argument) and says what it found, not the op's dtype=."""
    x, r, w = inputs()
    with pytest.raises(arnorm.InvalidInputError, match=message):
        arnorm.fused_allreduce_norm(hidden(x), r, w, group=arnorm.LOCAL, eps=1e-6)


def test_check_calls_at_tp1_reports_the_rejection_itself(clean_env):
    """ARNORM_CHECK_CALLS=1 with one rank (or every rank alike) rejecting a call raises that rejection,
    not a claim that ranks differ."""
    clean_env.setenv("ARNORM_CHECK_CALLS", "1")
    x, r, w = inputs(dtype=torch.bfloat16)
    with make(dtype=torch.bfloat16) as op, pytest.raises(arnorm.InvalidInputError) as err:
        op(x, r, w.float())
    assert str(err.value) == "weight: dtype torch.float32 (needs torch.bfloat16, the op's dtype)"


def test_a_call_with_no_tokens_is_told_to_skip_it(clean_env):
    """0 tokens: the fix is to skip the call (a larger max_tokens is the fix only for too many)."""
    x, r, w = inputs()
    with (
        make() as op,
        pytest.raises(arnorm.InvalidInputError, match=r"0 tokens \(needs 1 to \d+; skip a call"),
    ):
        op(x[:0], r[:0], w)


def test_custom_op_compiles_fullgraph(clean_env):
    """torch.compile(fullgraph=True) traces a call through torch.ops.arnorm with the same result."""
    x, r, w = inputs()
    with make(norm=arnorm.RMSNorm(1e-6, 1.0)) as op:

        def step(x, r, w):
            out = op(x, r, w)
            return out.normed * 2, out.residual

        expect_h, expect_y = add_rmsnorm(x.clone(), r, w, 1e-6, 1.0)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        y2, h = compiled(x, r, w)
        assert torch.equal(h, expect_h) and torch.equal(x, expect_h) and torch.equal(y2, expect_y * 2)


def test_custom_op_passes_opcheck(clean_env):
    """The functional custom op satisfies torch.library.opcheck (schema, fake, aliasing)."""
    x, r, w = inputs()
    with make(inplace=False) as op:
        torch.library.opcheck(
            torch.ops.arnorm.all_reduce_norm.default,
            (op._plan.handle, x, r, w, None),
            test_utils=("test_schema", "test_faketensor"),
        )


def test_choice_is_logged_once_at_info(clean_env, caplog):
    """Building an op logs the choice at INFO and each rejection at DEBUG."""
    import logging

    fake_backends.install(fake_backends.spec("picky", 90, "ProbeRejectsBackend"))
    with caplog.at_level(logging.DEBUG, logger="arnorm"), make():
        pass
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert info == ["arnorm: using reference for tp=1 hidden=32 float32 quant=none plain cpu (choice: auto)"]
    assert debug == ["arnorm: picky incompatible: topology: no NVLink (needs P2P access between the GPUs)"]


@pytest.mark.parametrize("quant", ["fp8_static", "fp8_per_token", "nvfp4", "mxfp8"])
def test_reference_serves_every_format_through_the_quantizers(clean_env, quant):
    """Each format's output is exactly arnorm.quant applied to the op's own normed output."""
    from arnorm.quant import quantize

    x, r, w = inputs(t=3, h=64, dtype=torch.bfloat16)
    scale = (
        torch.tensor([0.05 if quant == "fp8_static" else 448 * 6 / 3.0])
        if quant in ("fp8_static", "nvfp4")
        else None
    )
    with make(hidden_size=64, dtype=torch.bfloat16, quant=quant, backend="reference") as op:
        out = op(x, r, w, scale)
    expect = quantize(out.normed, quant, scale=scale, layout=op.problem.scale_layout)
    assert out.quant.format == quant and out.quant.layout == expect.layout
    assert torch.equal(out.quant.data.view(torch.uint8), expect.data.view(torch.uint8))
    assert torch.equal(out.quant.scale.view(torch.uint8), expect.scale.view(torch.uint8))


def test_trusted_weight_and_scale_do_not_hide_new_bad_ones(clean_env):
    """After a valid call, a different weight or scale tensor is checked again and rejected if wrong."""
    x, r, w = inputs()
    s = torch.tensor([0.1])
    with make(quant="fp8_static") as op:
        op(x.clone(), r, w, s)
        with pytest.raises(arnorm.InvalidInputError, match=r"weight: dtype torch.float16"):
            op(x.clone(), r, w.half(), s)
        with pytest.raises(arnorm.InvalidInputError, match=r"scale: dtype torch.float64"):
            op(x.clone(), r, w, s.double())
        with pytest.raises(arnorm.InvalidInputError, match=r"scale: shape \[2\]"):
            op(x.clone(), r, w, torch.ones(2))
        op(x.clone(), r, w, s)
