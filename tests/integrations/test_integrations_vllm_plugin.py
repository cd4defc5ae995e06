"""arnorm's vLLM plugin (``vllm.general_plugins``): what it routes, what it leaves alone and says so,
ARNORM_VLLM=0; and what the routed entry points do with a module's fp32 weights and inside capture.

Stand-in vLLM modules here; tests/vllm_lane runs the plugin inside vLLM's own engine.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import types
from importlib import metadata

import integ_fakes
import pytest
import torch

import arnorm
from arnorm.integrations import _common as integ_common
from arnorm.integrations import _vllm_groups as vllm_groups
from arnorm.integrations import _vllm_norms, _vllm_ops, _vllm_plugin
from arnorm.integrations import vllm as av

GEMMA_MODULE = "vllm.model_executor.layers.fused_allreduce_gemma_rms_norm"
PLAIN_MODULE = "vllm.models.common.ops.fused_allreduce_rms_norm"


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    integ_fakes.install_registry()
    monkeypatch.setattr(vllm_groups, "VLLM_STATE", [])
    monkeypatch.setattr(integ_common, "_WARNED", set())
    monkeypatch.setattr(_vllm_norms, "_cache", {})  # probes made here stay here
    monkeypatch.setattr(_vllm_plugin, "_REGISTERED", [], raising=False)  # a fresh register() per test
    av.configure()
    av.served_calls(reset=True)
    yield
    av.configure()


def _module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def vllm_gemma_helper(hidden_states, residual, norm):  # vLLM 0.33's signature
    raise AssertionError("vLLM's own helper ran")


def vllm_plain_helper_changed(hidden_states, residual, norm, *, out=None):  # a signature arnorm does not know
    raise AssertionError("vLLM's own helper ran")


def _install_helpers(monkeypatch) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """vLLM's two helper modules, and a model module that imported both by name before the plugin ran."""
    gemma = _module(monkeypatch, GEMMA_MODULE, fused_allreduce_gemma_rms_norm=vllm_gemma_helper)
    plain = _module(monkeypatch, PLAIN_MODULE, fused_allreduce_rms_norm=vllm_plain_helper_changed)
    model = _module(
        monkeypatch,
        "vllm.models.minimax_m3.nvidia.model",
        fused_allreduce_gemma_rms_norm=vllm_gemma_helper,
        fused_allreduce_rms_norm=vllm_plain_helper_changed,
    )
    return gemma, plain, model


def test_the_entry_point_is_declared_and_its_module_imports_nothing_heavy():
    """`pip install arnorm` declares the plugin vLLM loads; importing it imports neither torch nor vLLM."""
    points = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("arnorm") == "arnorm.integrations._vllm_plugin:register"
    code = (
        "import sys, arnorm.integrations._vllm_plugin as p; "
        "print(callable(p.register), sorted(m for m in ('torch', 'vllm', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True []"


def test_routes_known_helpers_everywhere_and_leaves_a_changed_signature_alone(monkeypatch, caplog):
    """The Gemma helper is replaced in vLLM's module and in a model module that already imported it;
    the plain helper, whose signature differs, is left alone; one log line per process says both."""
    gemma, plain, model = _install_helpers(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vllm.arnorm"):
        _vllm_plugin.register()
    assert gemma.fused_allreduce_gemma_rms_norm is av.fused_allreduce_gemma_rms_norm
    assert model.fused_allreduce_gemma_rms_norm is av.fused_allreduce_gemma_rms_norm
    assert plain.fused_allreduce_rms_norm is vllm_plain_helper_changed
    assert model.fused_allreduce_rms_norm is vllm_plain_helper_changed
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.arnorm"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("arnorm: routed vLLM's fused_allreduce_gemma_rms_norm to arnorm.integrations.vllm")
    assert (
        "fused_allreduce_rms_norm: signature (hidden_states, residual, norm, *, out=None) "
        "(needs (hidden_states, residual, norm): a vLLM arnorm does not know)"
    ) in line
    assert "allreduce_gemma_rms_norm_mxfp8: not in this vLLM" in line
    assert "backend: auto" in line


def test_a_module_imported_after_the_plugin_takes_arnorms_from_vllms_module(monkeypatch):
    _install_helpers(monkeypatch)
    _vllm_plugin.route()
    late = types.ModuleType("late_model")
    exec(f"from {GEMMA_MODULE} import fused_allreduce_gemma_rms_norm", late.__dict__)
    assert late.fused_allreduce_gemma_rms_norm is av.fused_allreduce_gemma_rms_norm
    assert _vllm_plugin.route().routed[0] == ("fused_allreduce_gemma_rms_norm", 0)  # again: nothing to do


def test_arnorm_vllm_0_leaves_vllms_helpers_to_vllm(monkeypatch, caplog, clean_env):
    """vLLM's helper stays vLLM's: behind a one-time check that every TP rank chose alike (here no
    TP group: nothing to check), after whose first call vLLM's own function is back everywhere."""

    def own(hidden_states, residual, norm):  # vLLM's helper (a fresh one: routing replaces names everywhere)
        raise AssertionError("vLLM's own helper ran")

    gemma = _module(monkeypatch, GEMMA_MODULE, fused_allreduce_gemma_rms_norm=own)
    model = _module(monkeypatch, "vllm.models.minimax_m3.nvidia.model", fused_allreduce_gemma_rms_norm=own)
    clean_env.setenv("ARNORM_VLLM", "0")
    assert arnorm.Config().vllm is False
    with caplog.at_level(logging.INFO, logger="vllm.arnorm"):
        _vllm_plugin.register()
    assert gemma.fused_allreduce_gemma_rms_norm.__wrapped__ is own
    with pytest.raises(AssertionError, match="vLLM's own helper ran"):
        model.fused_allreduce_gemma_rms_norm(None, None, None)
    assert gemma.fused_allreduce_gemma_rms_norm is own
    assert model.fused_allreduce_gemma_rms_norm is own
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.arnorm"]
    assert len(lines) == 1 and lines[0].startswith("arnorm: vLLM helpers left to vLLM"), lines
    assert "ARNORM_VLLM=0" in lines[0]


def test_a_malformed_setting_leaves_vllm_untouched_and_says_so(monkeypatch, caplog, clean_env):
    gemma, _, _ = _install_helpers(monkeypatch)
    clean_env.setenv("ARNORM_VLLM", "maybe")
    with caplog.at_level(logging.INFO, logger="vllm.arnorm"):
        _vllm_plugin.register()
    assert gemma.fused_allreduce_gemma_rms_norm is vllm_gemma_helper
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.arnorm"]
    assert len(lines) == 1 and "ARNORM_VLLM" in lines[0]


class Vllm033PlainNorm(integ_fakes._VllmNorm):
    """vLLM 0.33's RMSNorm through ``ir.ops.fused_add_rms_norm`` (native): ``x.to(weight.dtype) * weight``,
    so an fp16 weight rounds before the multiply and an fp32 one does not."""

    def forward_native(self, x, residual=None):
        self.calls += 1
        hf = x.float() + residual.float()
        n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (n.to(self.weight.dtype) * self.weight).to(x.dtype), hf.to(x.dtype)


Vllm033PlainNorm.__name__ = Vllm033PlainNorm.__qualname__ = "RMSNorm"


@pytest.mark.parametrize("kind", ["gemma", "plain"])
def test_fp32_module_weights_with_fp16_activations_are_bitwise(kind):
    """Issue 44: a module holding fp32 weights with fp16 activations. Weights fp16 represents run fused
    (exactly: the op reads the same values), bitwise the module's own result, and the plain norm's
    probe is made with its fp32 weight (which rounds once, not before the weight as with fp16)."""
    av.configure(group=arnorm.LOCAL, max_tokens=integ_fakes.FUSED_LIMIT)
    g = torch.Generator().manual_seed(44)
    x, residual = ((torch.randn(8, 64, generator=g) * 3).half() for _ in range(2))
    base = 0.0 if kind == "gemma" else 1.0
    w16 = (torch.randn(64, generator=g) * 0.3 + base).half()
    cls = integ_fakes.VllmGemmaNorm if kind == "gemma" else Vllm033PlainNorm
    entry = av.fused_allreduce_gemma_rms_norm if kind == "gemma" else av.fused_allreduce_rms_norm
    name = entry.__name__
    for weight in (w16, w16.float()):
        norm = cls(weight.clone(), 1e-6)
        want_y, want_h = norm.forward_native(x.clone(), residual.clone())
        got_y, got_h = entry(x.clone(), residual.clone(), norm)
        assert torch.equal(got_h, want_h) and torch.equal(got_y.view(torch.int16), want_y.view(torch.int16))
    assert av.served_calls(reset=True) == {name: {"fused": 2}}
    # A value fp16 cannot hold: vLLM's own path, and one warning that says why.
    w = w16.float()
    w[3] += 2.0**-20
    norm = cls(w, 1e-6)
    want_y, _ = norm.forward_native(x.clone(), residual.clone())
    with pytest.warns(arnorm.ArnormWarning, match=r"weight: dtype float32 with 1 of 64 values float16 does"):
        got_y, _ = entry(x.clone(), residual.clone(), norm)
    assert torch.equal(got_y.view(torch.int16), want_y.view(torch.int16))
    assert av.served_calls() == {name: {"unfused": 1}}


def test_the_probe_reads_the_modules_weight_dtype():
    """The plain norm's arithmetic is probed per weight dtype: fp16 weights round before the weight,
    fp32 weights once; neither probe warns (before issue 44 the fp32 one was judged with an fp16-rounded
    weight: a false mismatch, and the result was reused for the other dtype)."""
    from arnorm.integrations._vllm_norms import arithmetic_of

    w, cpu = torch.ones(64, dtype=torch.float16), torch.device("cpu")
    fp16_weights = arithmetic_of(Vllm033PlainNorm(w, 1e-6), 1e-6, 0.0, torch.float16, cpu)
    fp32_weights = arithmetic_of(Vllm033PlainNorm(w.float(), 1e-6), 1e-6, 0.0, torch.float16, cpu)
    assert fp16_weights.round_before_weight and not fp32_weights.round_before_weight
    assert fp16_weights.normalize_unrounded and fp32_weights.normalize_unrounded


class _CapturedTensor:
    """What ``entry`` reads of a CUDA tensor, on a machine without CUDA."""

    is_cuda = True
    shape = (4, 64)
    dtype = torch.bfloat16
    device = torch.device("cuda", 0)


def test_nothing_is_built_inside_cuda_graph_capture(monkeypatch):
    """A configuration first seen inside CUDA-graph capture runs unfused and builds nothing (building is
    collective); it is not remembered, so the next eager call builds the op."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    before = dict(_vllm_ops.ops)
    got = _vllm_ops.entry(_vllm_ops.local_tp(), _CapturedTensor(), arnorm.RMSNorm(1e-6), None, None, True)
    assert got.op is None and got.refused == _vllm_ops.IN_CAPTURE and not got.serves(4)
    assert _vllm_ops.ops == before


def vllm_plain_helper(hidden_states, residual, norm):  # vLLM 0.33's signature
    raise AssertionError("vLLM's own helper ran")


class _Unreadable(types.ModuleType):
    """A lazy module whose attribute access raises (not AttributeError), as some shims do."""

    def __getattribute__(self, name):
        raise RuntimeError(f"lazy module: cannot load {name}")


def test_a_module_that_raises_on_attribute_access_does_not_split_the_routing(monkeypatch, caplog):
    """Such a sys.modules entry, met between the two helpers, used to leave the Gemma helper routed
    and the plain one not while the log said both were left to vLLM. Now it is skipped: both routed,
    and the log says so; a failure part-way undoes every replacement (all or nothing)."""
    gemma = _module(monkeypatch, GEMMA_MODULE, fused_allreduce_gemma_rms_norm=vllm_gemma_helper)
    plain = _module(monkeypatch, PLAIN_MODULE, fused_allreduce_rms_norm=vllm_plain_helper)
    monkeypatch.setitem(sys.modules, "zz_lazy_shim", _Unreadable("zz_lazy_shim"))
    with caplog.at_level(logging.INFO, logger="vllm.arnorm"):
        _vllm_plugin.register()
    assert gemma.fused_allreduce_gemma_rms_norm is av.fused_allreduce_gemma_rms_norm
    assert plain.fused_allreduce_rms_norm is av.fused_allreduce_rms_norm
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vllm.arnorm"]
    assert line.startswith(
        "arnorm: routed vLLM's fused_allreduce_gemma_rms_norm, fused_allreduce_rms_norm to arnorm"
    ), line

    # All or nothing: the second helper's lookup fails after the first was replaced.
    gemma.fused_allreduce_gemma_rms_norm = vllm_gemma_helper
    plain.fused_allreduce_rms_norm = vllm_plain_helper
    real = _vllm_plugin._find

    def find(helper):
        if helper.name == "fused_allreduce_rms_norm":
            raise RuntimeError("boom")
        return real(helper)

    monkeypatch.setattr(_vllm_plugin, "_find", find)
    with pytest.raises(RuntimeError, match="boom"):
        _vllm_plugin.route()
    assert gemma.fused_allreduce_gemma_rms_norm is vllm_gemma_helper  # undone
    assert plain.fused_allreduce_rms_norm is vllm_plain_helper


def test_register_twice_logs_once(monkeypatch, caplog):
    """vLLM may load its plugins twice in one process: the routing line used to appear twice."""
    _install_helpers(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vllm.arnorm"):
        _vllm_plugin.register()
        _vllm_plugin.register()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.arnorm"]
    assert len(lines) == 1, lines
