"""The triton backend as arnorm sees it: registration, selection, probe reasons, AllReduceNorm calls."""

from __future__ import annotations

import pytest
import torch
from triton_cases import check_output, make_inputs, make_problem, make_scale

import arnorm
from arnorm.plugin import add_rmsnorm, check_capabilities
from arnorm_triton._backend import TritonBackend
from arnorm_triton._plugin import CAPABILITIES, TritonSettings, arnorm_backends

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def test_plugin_registers_triton_cheaply():
    """The entry point's hook returns the `triton` spec (priority 100, extra `triton`) and loads the class."""
    (spec,) = arnorm_backends()
    assert (spec.name, spec.priority, spec.requires, spec.extra) == ("triton", 100, ("triton",), "triton")
    assert spec.fix_hint() == "pip install 'arnorm[triton]'"
    assert spec.load() is TritonBackend
    info = {b.name: b for b in arnorm.backends()}["triton"]
    assert info.is_available and info.priority == 100


def test_auto_mode_selects_triton(clean_env):
    """Auto mode picks triton over the reference, and a call meets the contract in place."""
    partials, residual, weight = make_inputs(4, 512, torch.bfloat16, weight_offset=1.0, device=DEVICE)
    scale = make_scale("fp8_static", add_rmsnorm(partials[0], residual, weight, 1e-6, 1.0)[1])
    with arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=512,
        dtype=torch.bfloat16,
        norm=arnorm.RMSNorm(1e-6, 1.0),
        quant="fp8_static",
        device=DEVICE,
    ) as op:
        assert op.backend == "triton"
        assert "triton" in str(op.explain())
        x = partials[0].clone()
        out = op(x, residual, weight, scale)
    assert out.residual is x
    check_output(out, partials[0], residual, weight, op.problem, scale)


def test_strict_request_reports_the_width_limit(clean_env):
    """backend='triton' beyond 16384 fails with the capability reason in the grammar."""
    with pytest.raises(arnorm.ArnormError, match=r"hidden size: 32768 \(needs <= 16384\)"):
        arnorm.AllReduceNorm(
            arnorm.LOCAL,
            hidden_size=32768,
            dtype=torch.bfloat16,
            norm=arnorm.RMSNorm(1e-6),
            backend="triton",
            device=DEVICE,
        )


def test_static_capabilities():
    """The declared capabilities accept every format at any TP size, round_before_weight and
    strided rows, and reject rows beyond 16384 and widths that split a quantization block."""
    for quant, layout in [(None, None), ("nvfp4", "swizzled_128x4"), ("mxfp8", "linear")]:
        problem = make_problem(4096, torch.float16, quant, layout, world_size=3, round_before_weight=True)
        assert check_capabilities(CAPABILITIES, problem) == ()
    assert CAPABILITIES.strided_rows and CAPABILITIES.round_before_weight
    wide = make_problem(16400, torch.bfloat16)
    assert check_capabilities(CAPABILITIES, wide) == ("hidden size: 16400 (needs <= 16384)",)
    assert check_capabilities(CAPABILITIES, make_problem(1000, torch.bfloat16, "nvfp4", "linear")) == (
        "hidden size: 1000 (needs a multiple of 16 for nvfp4)",
    )
    assert check_capabilities(CAPABILITIES, make_problem(1040, torch.bfloat16, "mxfp8", "linear")) == (
        "hidden size: 1040 (needs a multiple of 32 for mxfp8)",
    )


def test_probe_keeps_only_what_cannot_be_declared(monkeypatch):
    """probe says nothing about sizes or formats (declared); it rejects CPU tensors without the
    interpreter."""

    def problem(h, quant=None, layout=None, device=DEVICE):
        return make_problem(h, torch.bfloat16, quant, layout, device=device)

    assert TritonBackend.probe(problem(1024, "nvfp4", "linear")) == ()
    assert TritonBackend.probe(problem(1000, "nvfp4", "linear")) == ()  # the capabilities' job
    assert TritonBackend.probe(problem(20000)) == ()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert TritonBackend.probe(problem(1024, device="cpu")) == (
        "platform: cpu (needs cuda or rocm, or TRITON_INTERPRET=1)",
    )


def test_probe_reports_missing_triton(monkeypatch):
    """Without triton importable, probe says how to install it (nothing else is checked)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    assert TritonBackend.probe(make_problem(1024, torch.bfloat16, device=DEVICE)) == (
        "triton: not importable (needs pip install 'arnorm[triton]')",
    )


def test_settings_are_the_backends_own(clean_env):
    """TritonSettings is declared on the spec and read from ARNORM_TRITON_EXACT / ARNORM_TRITON_PDL."""
    from arnorm._discovery import get_registry
    from arnorm._settings import backend_settings

    (spec,) = arnorm_backends()
    assert spec.settings is TritonSettings
    assert TritonSettings() == TritonSettings(exact=False, pdl=True)
    clean_env.setenv("ARNORM_TRITON_EXACT", "1")
    clean_env.setenv("ARNORM_TRITON_PDL", "0")
    settings = backend_settings(get_registry().get("triton").spec, None)
    assert settings == TritonSettings(exact=True, pdl=False)


def test_exact_mode_at_tp1_is_the_plain_kernel():
    """exact at TP 1 needs no gather: the backend runs the plain kernel and has no buffer."""
    from triton_cases import make_backend

    backend = make_backend(make_problem(256, torch.float32, device=DEVICE), exact=True)
    assert not backend.exact and backend.check_tokens(10**6) == ()
    assert backend.launcher.constexprs["NUM_PARTIALS"] == 1
