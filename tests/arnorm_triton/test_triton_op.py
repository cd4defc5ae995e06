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
    assert CAPABILITIES.strided_rows and "round_before_weight" in CAPABILITIES.norm_options
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
    from arnorm.registry._discovery import get_registry
    from arnorm.registry._load import backend_settings

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


FAST_CASES = [
    (None, None, True),
    ("fp8_static", None, False),
    ("fp8_per_token", None, True),
    ("nvfp4", "swizzled_128x4", False),
    ("mxfp8", "linear", True),
]


@pytest.mark.parametrize(("quant", "layout", "normed"), FAST_CASES)
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("add_residual", [True, False])
def test_fast_path_writes_what_call_writes(quant, layout, normed, inplace, with_out, add_residual):
    """triton's fast_path (the core's route at TP 1) and its __call__ give the same bits, fields
    and buffers, with and without out=, in place or not, with and without a residual."""
    from triton_cases import make_backend

    problem = make_problem(64, torch.bfloat16, quant, layout, normed_output=normed, inplace=inplace,
                           device=DEVICE)  # fmt: skip
    if not add_residual:
        import dataclasses

        problem = dataclasses.replace(problem, add_residual=False)
    backend = make_backend(problem)
    fast = backend.fast_path()
    assert fast is not None
    partials, residual, weight = make_inputs(3, 64, torch.bfloat16, device=DEVICE)
    residual = residual if add_residual else None
    scale = make_scale(quant, add_rmsnorm(partials[0], partials[0], weight, 1e-6, 0.0)[1])
    results = []
    for route in ("call", "fast"):
        x = partials[0].clone()
        out = None
        if with_out:
            op_out = arnorm.AllReduceNorm(
                arnorm.LOCAL, hidden_size=64, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), quant=quant,
                scale_layout=layout, normed_output=normed, inplace=inplace, max_tokens=8, device=DEVICE,
                backend="reference",
            )  # fmt: skip
            out = op_out.empty_output(3, scale)
            op_out.close()
        if route == "call":
            got = backend(x, residual, weight, scale, out)
        else:
            rp = 0 if residual is None else residual.data_ptr()
            sp = 0 if scale is None else scale.data_ptr()
            got = fast(3, x, residual, weight, scale, out, x.data_ptr(), rp, weight.data_ptr(), sp)
        assert (got.residual is x) == inplace
        if out is not None:
            assert got.normed is out.normed
            assert got.residual is (x if inplace else out.residual)
            assert got.quant is None or got.quant.data is out.quant.data
        results.append((x, got))
    (x1, a), (x2, b) = results
    assert torch.equal(x1, x2)
    for u, v in [(a.normed, b.normed), (a.residual, b.residual)] + (
        [] if a.quant is None else [(a.quant.data, b.quant.data), (a.quant.scale, b.quant.scale)]
    ):
        assert (u is None) == (v is None)
        if u is not None:
            assert torch.equal(u.view(torch.uint8), v.view(torch.uint8))
    if a.quant is not None:
        assert a.quant[2:] == b.quant[2:]  # format, layout, global scale


def test_no_fast_path_beyond_tp1():
    """At TP > 1 the all-reduce needs the tensors: fast_path() is None and calls go through __call__."""
    import types

    problem = make_problem(64, torch.float32, world_size=2, device=DEVICE)
    comm = types.SimpleNamespace(device=torch.device(DEVICE.type), world_size=2)
    assert TritonBackend(problem, comm, exact=False, pdl=False).fast_path() is None
