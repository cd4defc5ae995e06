"""arnorm's vLLM compile pass without vLLM: its policies as the plugin installs them (after, take, off,
ARNORM_VLLM=0, VLLM_BATCH_INVARIANT), a vLLM whose pass API differs, the rewrite on traced graphs
of vLLM's seam ops (stand-ins with vLLM 0.33's schemas and arithmetic), the op's fallbacks, the
cache key. tests/vllm_lane proves the same inside vLLM's own pass manager.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import integ_fakes
import integ_vllm_pass_fakes as F
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import arnorm
from arnorm.integrations import _common as integ_common
from arnorm.integrations import _vllm_pass_op as pass_op
from arnorm.integrations import _vllm_pass_rewrite as rewrite
from arnorm.integrations import _vllm_plugin
from arnorm.integrations import vllm as av
from arnorm.quant import FORMAT_SPECS
from arnorm.testing import run_ranks

T, H = 4, 64


@pytest.fixture
def fake_vllm(monkeypatch, clean_env):
    integ_fakes.install_registry()
    modules = F.install(monkeypatch)
    monkeypatch.setattr(integ_common, "_WARNED", set())
    monkeypatch.setattr(_vllm_plugin, "_REGISTERED", [])  # a fresh register() per test
    pass_op.reset()
    av.served_calls(reset=True)
    yield modules
    pass_op.reset()


def _pass_class():
    from arnorm.integrations._vllm_pass import ArnormFusionPass

    return ArnormFusionPass


def _register(caplog) -> str:
    with caplog.at_level(logging.INFO, logger="vllm.arnorm"):
        _vllm_plugin.register()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.arnorm"]
    assert len(lines) == 1, lines
    return lines[0]


# -- policies, as the plugin installs the pass ---------------------------------------------------------


def test_plugin_modules_import_neither_torch_nor_vllm():
    code = (
        "import sys, arnorm.integrations._vllm_plugin, arnorm.integrations._vllm_pass_install, "
        "arnorm.integrations._vllm_pass_table; "
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_default_policy_adds_the_pass_after_vllms_own(fake_vllm, caplog):
    line = _register(caplog)
    assert "compile pass: after (added to each engine config built here)" in line
    config = fake_vllm["vllm.engine.arg_utils"].EngineArgs().create_engine_config()
    added = config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(added, _pass_class()) and added.policy == "after" and not added.batch_invariant
    assert config.compilation_config.pass_config.fuse_allreduce_rms is True  # vLLM's pass stays on
    assert added.max_tokens == config.scheduler_config.max_num_batched_tokens
    assert torch.ops.arnorm.vllm_seam.default  # defined at plugin load: a cached graph calls it


def test_take_turns_vllms_allreduce_fusion_off(fake_vllm, caplog, clean_env):
    clean_env.setenv("ARNORM_VLLM_PASS", "take")
    line = _register(caplog)
    assert "compile pass: take" in line
    engine_args = fake_vllm["vllm.engine.arg_utils"].EngineArgs
    for args in (engine_args(), engine_args(compilation_config={"pass_config": {}})):
        config = args.create_engine_config()
        assert config.compilation_config.pass_config.fuse_allreduce_rms is False
        assert (
            config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"].policy == "take"
        )


def test_off_installs_nothing(fake_vllm, caplog, clean_env):
    clean_env.setenv("ARNORM_VLLM_PASS", "off")
    assert "compile pass: off (ARNORM_VLLM_PASS=off)" in _register(caplog)
    config = fake_vllm["vllm.engine.arg_utils"].EngineArgs().create_engine_config()
    assert "post_grad_custom_post_pass" not in config.compilation_config.inductor_compile_config


def test_arnorm_vllm_0_means_nothing_at_all(fake_vllm, caplog, clean_env):
    clean_env.setenv("ARNORM_VLLM", "0")
    clean_env.setenv("ARNORM_VLLM_PASS", "take")
    line = _register(caplog)
    assert "ARNORM_VLLM=0" in line and "compile pass: not installed (ARNORM_VLLM=0)" in line
    engine_args = fake_vllm["vllm.engine.arg_utils"].EngineArgs
    assert not hasattr(engine_args.create_engine_config, "__arnorm_policy__")
    config = engine_args().create_engine_config()
    assert config.compilation_config.inductor_compile_config == {}
    assert config.compilation_config.pass_config.fuse_allreduce_rms is True


def test_a_vllm_whose_pass_api_differs_is_left_alone(fake_vllm, caplog, monkeypatch):
    def configure_post_pass(self):  # a vLLM that no longer reads the slot
        return None

    monkeypatch.setattr(
        fake_vllm["vllm.compilation.backends"].VllmBackend, "configure_post_pass", configure_post_pass
    )
    line = _register(caplog)
    assert "compile pass: not installed (VllmBackend.configure_post_pass: does not add the " in line
    engine_args = fake_vllm["vllm.engine.arg_utils"].EngineArgs
    assert not hasattr(engine_args.create_engine_config, "__arnorm_policy__")
    monkeypatch.setattr(F.PassConfig, "__dataclass_fields__", {})
    assert "PassConfig.fuse_allreduce_rms: missing" in _register_again(caplog)


def _register_again(caplog) -> str:
    caplog.clear()
    _vllm_plugin._REGISTERED.clear()  # register() runs once per process: this is another process
    return _register(caplog)


def test_a_users_pass_in_the_slot_is_chained_and_runs_first(fake_vllm):
    from arnorm.integrations._vllm_pass_install import install

    seen = []

    class UserPass(F.InductorPass):
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "user-1"

    config = F.VllmConfig()
    config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"] = UserPass()
    added = install(config, "after")
    assert install(config, "after") is added  # once
    assert isinstance(added.chained, UserPass)
    before = added.uuid()
    added(torch.fx.Graph())
    assert seen == [0]
    added.chained.uuid = lambda: "user-2"
    assert added.uuid() != before


def test_batch_invariant_vllm_fuses_only_with_an_invariant_backend(fake_vllm, monkeypatch, caplog):
    fake_vllm["vllm.envs"].VLLM_BATCH_INVARIANT = True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert "only backends declaring batch invariance fuse" in _register(caplog)
    config = fake_vllm["vllm.engine.arg_utils"].EngineArgs().create_engine_config()
    assert config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"].batch_invariant
    x, res, w = _inputs(torch.bfloat16)
    # The fused test backend does not declare batch invariance: vLLM's unfused code, said once.
    with pytest.warns(arnorm.ArnormWarning, match="compile pass: seams run vLLM's unfused code"):
        for _ in range(2):
            _seam_call(x, res, w, batch_invariant=True)
    assert av.served_calls()[pass_op.ENTRY] == {"unfused": 2}
    _seam_call(x, res, w, batch_invariant=False)
    assert av.served_calls()[pass_op.ENTRY] == {"unfused": 2, "fused": 1}


# -- the op --------------------------------------------------------------------------------------------


def _inputs(dtype, tokens=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    res = (torch.randn(tokens, H, generator=g) * 2).to(dtype)
    w = (torch.randn(H, generator=g) * 0.3).to(dtype)
    return x, res, w


def _seam_call(x, res, w, *, gemma=False, max_tokens=16, batch_invariant=False, eps=1e-6):
    pass_op.define()
    return torch.ops.arnorm.vllm_seam(
        x, res, w, None, F.GROUP, eps, gemma, "", True, max_tokens, batch_invariant
    )


def test_the_op_is_fused_within_budget_and_vllms_code_above_it(fake_vllm):
    coordinator = F.coordinator()
    for tokens, path in ((4, "fused"), (16, "fused"), (17, "unfused")):
        x, res, w = _inputs(torch.bfloat16, tokens)
        before = coordinator.reductions
        y, r, codes, scales = _seam_call(x, res, w)
        want_y, want_r = F.fused_add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(y, want_y) and torch.equal(r, want_r)
        assert codes.numel() == 0 and scales.numel() == 0
        assert coordinator.reductions - before == (path == "unfused")  # vLLM's all_reduce only unfused
    assert av.served_calls()[pass_op.ENTRY] == {"fused": 2, "unfused": 1}


def test_an_op_that_cannot_be_built_falls_back_with_one_warning(fake_vllm, monkeypatch):
    from arnorm._errors import NoEligibleBackendError

    def refuse(*args, **kwargs):
        raise NoEligibleBackendError("backend: none serves this (needs one)")

    monkeypatch.setattr("arnorm.op._op.AllReduceNorm.__init__", refuse)
    x, res, w = _inputs(torch.float16)
    with pytest.warns(arnorm.ArnormWarning) as record:
        for _ in range(3):
            y, _, _, _ = _seam_call(x, res, w)
    assert len([w for w in record if "unfused code" in str(w.message)]) == 1
    assert "NoEligibleBackendError: backend: none serves this" in str(record[0].message)
    assert torch.equal(y, F.fused_add_rms_norm(x, res, w, 1e-6)[0])
    assert av.served_calls()[pass_op.ENTRY] == {"unfused": 3}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "broken_on", "warning"),
    [
        ([{}, {"ARNORM_BACKEND": "fused"}], None, "InvalidInputError: ranks disagree on backend preference"),
        ([{}, {}], 1, "op: only arnorm's reference serves this configuration (needs a fused backend)"),
    ],
    ids=["settings-differ-on-one-rank", "backend-fails-on-one-rank"],
)
def test_an_op_that_cannot_be_built_on_one_rank_falls_back_alike_on_every_rank(env, broken_on, warning):
    """TP 2 (gloo): the op cannot be built because of one rank (its ARNORM_BACKEND, or the fused
    backend failing to build there). Every rank runs vLLM's unfused code for every call, with one
    warning, the same text on every rank; none waits on a collective the other does not make."""
    import integ_vllm_pass_ranks

    results = run_ranks(2, integ_vllm_pass_ranks.seam_calls, [4, 16, 17], broken_on, env=env, timeout=180)
    for r in results:
        assert r["equal"] == [True, True, True], r
        assert r["served"] == {"unfused": 3}, r
        assert len(r["warnings"]) == 1 and warning in r["warnings"][0], r
    assert results[0]["warnings"] == results[1]["warnings"]


@pytest.mark.slow
def test_the_op_fuses_on_every_rank_at_tp2():
    import integ_vllm_pass_ranks

    for r in run_ranks(2, integ_vllm_pass_ranks.seam_calls, [4, 16, 17], timeout=180):
        assert r == {"equal": [True, True, True], "warnings": [], "served": {"fused": 2, "unfused": 1}}


def test_fake_outputs_have_vllms_buffer_shapes():
    with torch._subclasses.FakeTensorMode():
        x = torch.empty(130, 256, dtype=torch.bfloat16)
        y, r, codes, scales = pass_op._outputs_like(x, "nvfp4", False)
        assert y.numel() == 0 and r.shape == x.shape
        assert (codes.shape, codes.dtype) == ((130, 128), torch.uint8)
        assert (scales.shape, scales.dtype) == ((256, 4), torch.int32)  # vLLM's swizzled int32 words
        _, _, codes, scales = pass_op._outputs_like(x, "fp8_per_token", True)
        assert (codes.dtype, scales.shape) == (torch.float8_e4m3fn, (130, 1))


def test_uuid_changes_with_arnorms_version_and_what_it_matches(fake_vllm, monkeypatch):
    from arnorm.integrations import _vllm_pass_table as table

    p = _pass_class()("after", 16, False)
    first = p.uuid()
    assert first == _pass_class()("after", 16, False).uuid()  # the same in every process
    assert _pass_class()("take", 16, False).uuid() != first
    assert _pass_class()("after", 16, True).uuid() != first
    version = arnorm.__version__
    monkeypatch.setattr(arnorm, "__version__", "9.9.9")
    assert p.uuid() != first
    monkeypatch.setattr(arnorm, "__version__", version)
    assert p.uuid() == first
    monkeypatch.setitem(table.TAILS, "mxfp4", table.TAILS["fp8_static"])
    assert _pass_class()("after", 16, False).uuid() != first


# -- the rewrite, on traced graphs of vLLM's seam ops ------------------------------------------------------


def _two_layers(gemma: bool, residual: bool, eps: float):
    """vLLM's seam code, as its models run it: the all-reduce of a row-parallel output, then the next
    norm (``GemmaRMSNorm`` passes ``weight.float() + 1``), two layers."""

    def weight(w):
        return w.float() + 1.0 if gemma else w

    def model(x1, x2, res, w1, w2):
        a = torch.ops.vllm.all_reduce(x1, F.GROUP)
        if residual:
            y, r = torch.ops.vllm_ir.fused_add_rms_norm(a, res, weight(w1), eps)
        else:
            y, r = torch.ops.vllm_ir.rms_norm(a, weight(w1), eps), a
        b = torch.ops.vllm.all_reduce(x2 * y, F.GROUP)
        return torch.ops.vllm_ir.fused_add_rms_norm(b, r, weight(w2), eps)

    return model


def _seam_inputs(dtype):
    x1, res, w1 = _inputs(dtype, seed=1)
    x2, _, w2 = _inputs(dtype, seed=2)
    return x1, x2, res, w1, w2


def _bitwise(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 3e-7])
@pytest.mark.parametrize("gemma", [False, True], ids=["plain", "gemma"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
def test_every_seam_is_fused_and_bitwise_equal_to_vllms_code(fake_vllm, dtype, eps, gemma, residual):
    model = _two_layers(gemma, residual, eps)
    args = _seam_inputs(dtype)
    gm = make_fx(model, tracing_mode="fake")(*args)
    _pass_class()("after", 16, False)(gm.graph)
    from arnorm.integrations._vllm_pass import reports

    report = reports(reset=True)[-1]
    norm = ("gemma_" if gemma else "") + ("add_rms_norm" if residual else "rms_norm")
    assert sorted(report["fused"]) == sorted([norm, ("gemma_" if gemma else "") + "add_rms_norm"]), report
    targets = [str(n.target) for n in gm.graph.nodes]
    assert "vllm.all_reduce.default" not in targets and not any(t.startswith("vllm_ir.") for t in targets)
    gm.graph.lint()
    gm.recompile()
    for got, want in zip(gm(*args), model(*args), strict=True):
        assert _bitwise(got, want)
    assert av.served_calls()[pass_op.ENTRY] == {"fused": 2}


def test_the_pass_makes_no_collective_and_builds_nothing(fake_vllm, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a collective or an op built at trace time")

    monkeypatch.setattr("arnorm.op._op.AllReduceNorm.__init__", forbidden)
    monkeypatch.setattr(torch.distributed, "all_reduce", forbidden)
    monkeypatch.setattr(F.Coordinator, "all_reduce", forbidden)
    model = _two_layers(True, True, 1e-6)
    gm = make_fx(model, tracing_mode="fake")(*_seam_inputs(torch.bfloat16))
    _pass_class()("after", 16, False)(gm.graph)
    assert any(str(n.target) == "arnorm.vllm_seam.default" for n in gm.graph.nodes)


def test_an_unexpected_seam_leaves_the_whole_graph_alone(fake_vllm):
    def model(x1, x2, res, w1, w2):
        a = torch.ops.vllm.all_reduce(x1, F.GROUP)  # a fusable seam ...
        y, r = torch.ops.vllm_ir.fused_add_rms_norm(a, res, w1, 1e-6)
        b = torch.ops.vllm.all_reduce(
            x2, F.GROUP
        )  # ... and one normalized twice: a shape arnorm does not know
        return y, r, torch.ops.vllm_ir.rms_norm(b, w1, 1e-6), torch.ops.vllm_ir.rms_norm(b, w2, 1e-5)

    gm = make_fx(model, tracing_mode="fake")(*_seam_inputs(torch.bfloat16))
    before = str(gm.graph)
    the_plan = rewrite.plan(gm.graph)
    assert the_plan.unexpected and "normalized by 2 norms" in the_plan.unexpected
    _pass_class()("after", 16, False)(gm.graph)
    assert str(gm.graph) == before


def test_a_rewrite_failing_part_way_leaves_the_whole_graph_alone(fake_vllm, monkeypatch, caplog):
    """A seam the plan accepted but the rewrite cannot emit (here the second seam's outputs fail):
    the graph vLLM compiles is the one it had, not one with the first seam rewritten, and the pass
    says why instead of raising into vLLM's compilation."""
    calls = []
    real = rewrite._fake_outputs

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) % 2 == 0:
            raise RuntimeError("no fake outputs for this seam")
        return real(*args, **kwargs)

    monkeypatch.setattr(rewrite, "_fake_outputs", second_fails)
    model = _two_layers(False, True, 1e-6)
    args = _seam_inputs(torch.bfloat16)
    gm = make_fx(model, tracing_mode="fake")(*args)
    assert len(rewrite.plan(gm.graph).seams) == 2
    before = str(gm.graph)
    with caplog.at_level(logging.WARNING, logger="vllm.arnorm"):
        _pass_class()("after", 16, False)(gm.graph)
    assert str(gm.graph) == before
    from arnorm.integrations._vllm_pass import reports

    report = reports(reset=True)[-1]
    assert report["fused"] == [] and report["unexpected"] == (
        "rewrite failed: RuntimeError: no fake outputs for this seam"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "vllm.arnorm"] == [
        "arnorm: compile pass left a graph alone: rewrite failed: RuntimeError: no fake outputs for this seam"
    ]
    gm.recompile()
    for got, want in zip(gm(*args), model(*args), strict=True):
        assert _bitwise(got, want)  # vLLM's own ops, as traced


def test_a_norm_arnorm_cannot_match_is_left_to_vllm(fake_vllm):
    def model(x1, x2, res, w1, w2):
        a = torch.ops.vllm.all_reduce(x1, F.GROUP)
        y, r = torch.ops.vllm_ir.fused_add_rms_norm(a, res, w1.float(), 1e-6)  # an fp32 weight
        b = torch.ops.vllm.all_reduce(x2, F.GROUP)
        return (y, r, *torch.ops.vllm_ir.fused_add_rms_norm(b, r, w2, 1e-6))

    args = _seam_inputs(torch.bfloat16)
    gm = make_fx(model, tracing_mode="fake")(*args)
    the_plan = rewrite.plan(gm.graph)
    assert [s.kind() for s in the_plan.seams] == ["add_rms_norm"]
    assert len(the_plan.left) == 1 and "weight dtype torch.float32 (needs torch.bfloat16" in the_plan.left[0]
    rewrite.rewrite(gm.graph, the_plan, pass_op.define(), 16, False)
    gm.graph.lint()
    gm.recompile()
    for got, want in zip(gm(*args), model(*args), strict=True):
        assert _bitwise(got, want)


@pytest.mark.slow
def test_inductor_compiles_the_rewritten_graph_with_a_static_fp8_tail(fake_vllm):
    """Inductor's own post-grad hook, as vLLM's pass manager calls the pass: the quantization vLLM
    emits after the norm (functionalized) is fused too, codes bitwise."""

    def model(x1, x2, w1, g, scale):
        a = torch.ops.vllm.all_reduce(x1, F.GROUP)
        y0 = torch.ops.vllm_ir.rms_norm(a, w1, 1e-5, None)
        y, r = torch.ops.vllm_ir.fused_add_rms_norm(
            torch.ops.vllm.all_reduce(x2 * 2, F.GROUP), a, g.float() + 1, 1e-6
        )
        q = torch.empty(y.shape, dtype=torch.float8_e4m3fn)
        torch.ops._C.static_scaled_fp8_quant(q, y, scale, [-1, -1])
        return q, r, y0

    x1, x2, _, w1, g = _seam_inputs(torch.bfloat16)
    args = (x1, x2, w1, g * 0.1, torch.tensor([0.05]))
    want = model(*args)
    the_pass = _pass_class()("after", 16, False)
    torch._dynamo.reset()
    options = {"post_grad_custom_post_pass": the_pass, "enable_auto_functionalized_v2": False}
    # A cache hit skips every post-grad pass (the cached graph is the rewritten one): this test
    # needs the pass itself to run, whatever an earlier run left in the on-disk caches.
    with torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):  # fmt: skip
        got = torch.compile(model, backend="inductor", options=options, dynamic=False)(*args)
    assert sorted(av.compile_pass_reports()[-1]["fused"]) == ["gemma_add_rms_norm+fp8_static", "rms_norm"]
    assert all(_bitwise(a, b) for a, b in zip(got, want, strict=True))
    assert av.served_calls()[pass_op.ENTRY] == {"fused": 2}


@pytest.mark.slow
def test_inductors_cache_of_another_arnorm_version_is_not_used(fake_vllm, monkeypatch, tmp_path):
    """Inductor's own on-disk cache, as a second process of vLLM meets it: a graph compiled with
    this arnorm is a cache hit (the pass does not run again); the same graph with another arnorm
    version is a miss, so the pass runs again and the compiled code calls this version's op."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def model(x1, x2, res, w1, w2):
        a = torch.ops.vllm.all_reduce(x1, F.GROUP)
        y, r = torch.ops.vllm_ir.fused_add_rms_norm(a, res, w1, 1e-6)
        return y, r

    args = _seam_inputs(torch.bfloat16)
    want = model(*args)
    from arnorm.integrations._vllm_pass import reports

    def compile_once() -> int:
        torch._dynamo.reset()
        reports(reset=True)
        options = {"post_grad_custom_post_pass": _pass_class()("after", 16, False)}
        with torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=True):  # fmt: skip
            got = torch.compile(model, backend="inductor", options=options, dynamic=False)(*args)
        assert all(_bitwise(a, b) for a, b in zip(got, want, strict=True))
        return len(reports())

    assert compile_once() == 1  # compiled: the pass ran
    assert compile_once() == 0  # the cache served this version's graph
    monkeypatch.setattr(arnorm, "__version__", "0.0.1+other")
    assert compile_once() == 1  # another version: compiled again, the pass ran again
    assert av.served_calls()[pass_op.ENTRY] == {"fused": 3}


def test_compile_pass_reports_is_empty_where_no_pass_ran():
    code = "from arnorm.integrations import vllm; print(vllm.compile_pass_reports())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- the per-token-group fp8 tails (vLLM's per_token_group_quant_fp8 after the norm) ---------------------

GROUP_TAILS = [
    (fmt, layout)
    for fmt in ("fp8_per_group", "fp8_per_group_64", "fp8_per_group_ue8m0", "fp8_per_group_64_ue8m0")
    for layout in ("linear", "column_major", "column_major_tma")
]


def _group_scale_buffer(t, h, group, layout):
    """The scale buffer vLLM's ``per_token_group_quant_fp8`` allocates for ``layout`` (fp8_utils.py)."""
    cols = h // group
    if layout == "column_major":
        return torch.empty(cols, t).permute(-1, -2)
    if layout == "column_major_tma":
        return torch.empty_strided((t, cols), (1, -(t // -4) * 4))  # get_tma_aligned_size(t, 4)
    return torch.empty(t, cols)


def _group_model(fmt, layout, flags=None):
    """A seam then vLLM's per-token-group quantization of the normed output, functionalized as vLLM's
    graphs hold it (``auto_functionalized``, as matcher_utils.MatcherQuantFP8 writes it)."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    spec = FORMAT_SPECS[fmt]
    transposed, tma = flags or (layout != "linear", layout == "column_major_tma")

    def model(x1, res, w1):
        a = torch.ops.vllm.all_reduce(x1, F.GROUP)
        y, r = torch.ops.vllm_ir.fused_add_rms_norm(a, res, w1, 1e-6)
        q = torch.empty(y.shape, dtype=torch.float8_e4m3fn)
        s = _group_scale_buffer(y.shape[0], y.shape[1], spec.block_size, layout)
        out = auto_functionalized(
            torch.ops._C.per_token_group_fp8_quant.default, input=y, output_q=q, output_s=s,
            group_size=spec.block_size, eps=1e-10, fp8_min=-448.0, fp8_max=448.0,
            scale_ue8m0=spec.pow2_scales, dummy_is_scale_transposed=transposed, dummy_is_tma_aligned=tma,
        )  # fmt: skip
        return out[1], out[2], r  # what vLLM's graphs read of it (the op returns nothing itself)

    return model


def _trace(model, args, mode="fake"):
    """``model``'s graph as a post-grad graph holds it: outputs nobody reads dropped (Inductor's
    post-grad passes remove them before the custom post pass runs)."""
    gm = make_fx(model, tracing_mode=mode)(*args)
    gm.graph.eliminate_dead_code()
    return gm


def _same_tensor(a, b):
    """Equal bits, shape, dtype and strides (vLLM's block-FP8 GEMMs read the scales' strides)."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))  # fmt: skip


def _group_inputs(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=g).to(dtype)
    res = (torch.randn(tokens, 256, generator=g) * 2).to(dtype)
    return x, res, (torch.randn(256, generator=g) * 0.3).to(dtype)


@pytest.mark.parametrize(("fmt", "layout"), GROUP_TAILS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_per_token_group_fp8_tail_is_fused_bitwise_with_vllms_strides(fake_vllm, fmt, layout, dtype):
    model = _group_model(fmt, layout)
    args = _group_inputs(dtype, 5)  # 5 tokens: the TMA layout pads its rows to 8
    gm = _trace(model, args)
    _pass_class()("after", 16, False)(gm.graph)
    key = fmt if layout == "linear" else f"{fmt}@{layout}"
    assert av.compile_pass_reports(reset=True)[-1]["fused"] == [f"add_rms_norm+{key}"]
    targets = [str(n.target) for n in gm.graph.nodes]
    assert not any("per_token_group" in str(n.args[0]) for n in gm.graph.nodes if n.args and
                   "auto_functionalized" in str(n.target))  # fmt: skip
    assert "vllm.all_reduce.default" not in targets
    gm.graph.lint()
    gm.recompile()
    for got, want in zip(gm(*args), model(*args), strict=True):
        assert _same_tensor(got, want)
    assert av.served_calls()[pass_op.ENTRY] == {"fused": 1}


@pytest.mark.parametrize("layout", ["column_major", "column_major_tma"])
def test_a_group_tail_is_matched_with_a_symbolic_token_count(fake_vllm, layout):
    """vLLM compiles for a range of token counts: the buffer's strides are expressions of T, which
    the tail's must equal as written (``-(T // -4) * 4`` for TMA), not merely at one T."""
    model = _group_model("fp8_per_group_64_ue8m0", layout)
    gm = _trace(model, _group_inputs(torch.float16, 5), "symbolic")
    kinds = [s.kind() for s in rewrite.plan(gm.graph).seams]
    assert kinds == [f"add_rms_norm+fp8_per_group_64_ue8m0@{layout}"]


@pytest.mark.parametrize("tokens", [1, 16, 17])
def test_a_group_tail_above_the_budget_runs_vllms_quantizer_with_its_strides(fake_vllm, tokens):
    model = _group_model("fp8_per_group_ue8m0", "column_major_tma")
    args = _group_inputs(torch.bfloat16, tokens)
    gm = _trace(model, _group_inputs(torch.bfloat16, 5))
    _pass_class()("after", 16, False)(gm.graph)
    gm.recompile()
    # Traced at 5 tokens, called at others: the pass's op takes T from its input.
    for got, want in zip(gm(*args), model(*args), strict=True):
        assert got.shape == want.shape and torch.equal(got.float(), want.float())
    path = "unfused" if tokens > 16 else "fused"
    assert av.served_calls()[pass_op.ENTRY] == {path: 1}


def test_a_scale_buffer_its_flags_misname_is_left_to_vllm(fake_vllm):
    # A row-major buffer that the flags call transposed: the kernel writes by the strides, arnorm
    # would give the layout the flags name; the quantization is not taken, the seam still is.
    model = _group_model("fp8_per_group", "linear", flags=(True, False))
    gm = _trace(model, _group_inputs(torch.bfloat16, 5))
    the_plan = rewrite.plan(gm.graph)
    assert [s.kind() for s in the_plan.seams] == ["add_rms_norm"]


def test_group_fake_outputs_have_vllms_shapes_and_strides():
    with torch._subclasses.FakeTensorMode():
        x = torch.empty(5, 512, dtype=torch.bfloat16)
        for layout in ("linear", "column_major", "column_major_tma"):
            key = "fp8_per_group_64" if layout == "linear" else f"fp8_per_group_64@{layout}"
            _, _, codes, scales = pass_op._outputs_like(x, key, False)
            want = _group_scale_buffer(5, 512, 64, layout)
            assert (codes.shape, codes.dtype) == ((5, 512), torch.float8_e4m3fn)
            assert (scales.shape, scales.stride(), scales.dtype) == (want.shape, want.stride(), torch.float32)


def test_the_packed_ue8m0_and_mxfp4_quantizers_are_left_to_vllm(fake_vllm):
    """DeepGEMM's packed scales and FlashInfer's mxfp4 quantizer: the seam is fused, the
    quantization stays vLLM's (the table says why)."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    from arnorm.integrations._vllm_pass_table import TAIL_BY_OP

    def model(x1, res, w1):
        a = torch.ops.vllm.all_reduce(x1, F.GROUP)
        y, r = torch.ops.vllm_ir.fused_add_rms_norm(a, res, w1, 1e-6)
        q = torch.empty(y.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty_strided((y.shape[0], 1), (1, 8), dtype=torch.int32)
        out = auto_functionalized(
            torch.ops._C.per_token_group_fp8_quant_packed.default, input=y, output_q=q, output_s_packed=s,
            group_size=128, eps=1e-10, fp8_min=-448.0, fp8_max=448.0,
        )  # fmt: skip
        return out[1], out[2], r, *torch.ops.vllm.flashinfer_mxfp4_quantize(y, "cute-dsl")

    gm = _trace(model, _group_inputs(torch.bfloat16, 5))
    the_plan = rewrite.plan(gm.graph)
    assert [s.kind() for s in the_plan.seams] == ["add_rms_norm"]
    assert not any("packed" in op or "mxfp4" in op for op in TAIL_BY_OP)
