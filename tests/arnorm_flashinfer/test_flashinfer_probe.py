"""The flashinfer backend's plugin descriptor and every rejection reason of its probe."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import subprocess
import sys

import pytest
from fake_flashinfer import fake_fi_fixture, install, make_problem  # noqa: F401  (fixture)

from arnorm.registry._capabilities import check_capabilities
from arnorm_flashinfer._backend import FlashInferBackend
from arnorm_flashinfer._plugin import CAPABILITIES, arnorm_backends
from arnorm_flashinfer._rules import max_hidden

GRAMMAR = re.compile(r"^[^:]+: .+ \(needs .+\)$")


def probe(**overrides):
    """The declared capabilities' reasons, then the probe's (as selection asks them)."""
    problem = make_problem(**overrides)
    reasons = check_capabilities(CAPABILITIES, problem) + tuple(FlashInferBackend.probe(problem))
    for r in reasons:
        assert GRAMMAR.match(r), r
    return reasons


def test_spec_registers_flashinfer_at_300():
    (spec,) = arnorm_backends()
    assert spec.name == "flashinfer"
    assert spec.priority == 300
    assert spec.loader == "arnorm_flashinfer._backend:FlashInferBackend"
    assert spec.requires == ("flashinfer",)
    assert spec.extra == "flashinfer"
    assert spec.distribution == "flashinfer-python"
    caps = spec.capabilities
    assert caps.platforms == {"cuda"}
    assert caps.world_sizes == {2, 4, 8, 16}
    assert caps.min_arch == (9, 0)
    assert caps.quant_min_arch == {"nvfp4": (10, 0)}
    assert caps.arch_majors == {9, 10, 12}
    assert caps.quant_dtypes == {"nvfp4": {"bfloat16", "float16"}}
    assert caps.quant == {"none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"}
    assert caps.hidden_multiple == 8
    assert spec.load() is FlashInferBackend


def test_plugin_and_package_import_nothing_heavy():
    code = (
        "import sys, arnorm_flashinfer, arnorm_flashinfer._plugin as p; p.arnorm_backends(); "
        "print(sorted(m for m in ('torch', 'flashinfer', 'arnorm_flashinfer._backend') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_not_installed_is_reported_with_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # find_spec() answers None, as when missing
    (spec,) = arnorm_backends()
    assert spec.missing_requirements() == ("flashinfer",)
    assert spec.fix_hint() == "pip install 'arnorm[flashinfer]'"
    assert probe() == ("flashinfer: not installed (needs pip install 'arnorm[flashinfer]')",)


def test_static_capabilities_reject_tp1_and_nvfp4_on_sm90():
    assert check_capabilities(CAPABILITIES, make_problem(world_size=1)) == (
        "world size: 1 (needs 2, 4, 8 or 16)",
    )
    (reason,) = check_capabilities(CAPABILITIES, make_problem(quant="nvfp4"))
    assert reason.startswith("compute capability: 9.0 (needs >= 10.0 for nvfp4")
    assert check_capabilities(CAPABILITIES, make_problem(quant="nvfp4", arch=(10, 0))) == ()


def test_eligible_problems_have_no_reasons(fake_fi):
    assert probe() == ()
    assert probe(dtype="float32", hidden_size=4096) == ()
    assert probe(quant="fp8_static", normed_output=False) == ()
    assert probe(quant="fp8_per_token", dtype="float16") == ()
    assert probe(quant="mxfp8", scale_layout="swizzled_128x4") == ()
    assert probe(quant="mxfp8", dtype="float32") == ()  # the MXFP8 patterns are built for float too
    assert probe(quant="nvfp4", arch=(10, 0), scale_layout="linear") == ()
    assert probe(world_size=16, arch=(12, 0)) == ()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"world_size": 1}, "world size: 1 (needs 2, 4, 8 or 16)"),
        ({"world_size": 3}, "world size: 3 (needs 2, 4, 8 or 16)"),
        ({"world_size": 32}, "world size: 32 (needs 2, 4, 8 or 16)"),
        ({"platform": "rocm", "arch": None}, "platform: rocm (needs cuda)"),
        ({"arch": (8, 0)}, "compute capability: 8.0 (needs >= 9.0)"),
        ({"arch": (11, 0)}, "compute capability: 11.0 (needs 9.x, 10.x or 12.x)"),
        ({"quant": "nvfp4"}, "compute capability: 9.0 (needs >= 10.0 for nvfp4)"),
        (
            {"quant": "nvfp4", "arch": (10, 0), "dtype": "float32"},
            "dtype: float32 (needs bfloat16 or float16 for nvfp4)",
        ),
        ({"hidden_size": 68}, "hidden size: 68 (needs a multiple of 8)"),
        (
            {"quant": "mxfp8", "scale_layout": "swizzled_8x4"},
            "scale layout: swizzled_8x4 (needs linear or swizzled_128x4",
        ),
        ({"hidden_size": 8200}, "hidden size: 8200 (needs <= 8192 for bfloat16 at this alignment"),
        ({"hidden_size": 131072}, "hidden size: 131072 (needs <= 65536)"),
    ],
)
def test_rejection_reasons(fake_fi, overrides, expected):
    """Each limit of FlashInfer's kernels is rejected with its own reason, declared or probed."""
    reasons = probe(**overrides)
    assert any(r.startswith(expected) for r in reasons), reasons


def test_max_hidden_follows_the_cluster_rule():
    assert max_hidden(8192, 2) == 65536  # H/8 = 1024 threads: cluster 8
    assert max_hidden(4104, 2) == 8192  # H/8 = 513 (odd): cluster 1
    assert max_hidden(4112, 2) == 16384  # H/8 = 514: cluster 2
    assert max_hidden(4096, 4) == 32768  # fp32: 4 elements per thread


def test_import_failure_is_a_reason(monkeypatch):
    install(monkeypatch)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", None)  # "import of flashinfer.comm halted"
    (reason,) = probe()
    assert reason.startswith("flashinfer.comm: import failed: ModuleNotFoundError: import of flashinfer.comm")
    assert reason.endswith("(needs a working flashinfer-python install)")


class _BrokenLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError("libcuda.so.1: cannot open shared object file\nsecond line")


class _BrokenFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "flashinfer.comm":
            return importlib.machinery.ModuleSpec(name, _BrokenLoader())
        return None


def test_any_import_time_exception_is_a_reason(monkeypatch):
    install(monkeypatch)
    monkeypatch.delitem(sys.modules, "flashinfer.comm")
    monkeypatch.delattr(sys.modules["flashinfer"], "comm")
    monkeypatch.setattr(sys, "meta_path", [_BrokenFinder(), *sys.meta_path])
    assert probe() == (
        "flashinfer.comm: import failed: OSError: libcuda.so.1: cannot open shared object file "
        "(needs a working flashinfer-python install)",
    )


def test_mxfp8_needs_the_patterns_not_a_version_string(monkeypatch):
    install(monkeypatch, version="0.7.2")
    assert probe(quant="mxfp8") == ("flashinfer: 0.7.2 has no MXFP8 fusion patterns (needs >= 0.7.4)",)
    assert probe(quant="fp8_static") == ()
    install(monkeypatch, version="0.7.3")  # a version string that proves nothing: the attribute decides
    assert probe(quant="mxfp8") != ()


def test_old_api_without_group_is_rejected(monkeypatch):
    install(monkeypatch, version="0.6.0", old_api=True)
    (reason,) = probe()
    assert reason == "flashinfer: 0.6.0 has no create_allreduce_fusion_workspace(group=) (needs >= 0.7.2)"


def test_probe_enters_no_collective_and_builds_nothing(fake_fi):
    probe(quant="fp8_static")
    assert fake_fi.builds == [] and fake_fi.creates == [] and fake_fi.calls == []


NEW_FORMATS = {
    "fp8_per_group": "column_major_tma",
    "fp8_per_group_64": "linear",
    "fp8_per_group_ue8m0": "packed_ue8m0",
    "fp8_per_group_64_ue8m0": "column_major",
    "mxfp4": "linear",
}


@pytest.mark.parametrize(("fmt", "layout"), NEW_FORMATS.items())
def test_the_group_formats_and_mxfp4_are_declined_saying_why(fmt, layout):
    """Not declared (docs/numerics.md 3.5: patterns 8/9 floor the scale after the division): the
    reason names the format and what flashinfer serves, and a layout its kernel does not write."""
    reasons = check_capabilities(CAPABILITIES, make_problem(hidden_size=256, quant=fmt, scale_layout=layout))
    assert f"quant: {fmt} (needs fp8_per_token, fp8_static, mxfp8, none or nvfp4)" in reasons
    if layout not in ("linear", "swizzled_128x4"):
        assert f"scale layout: {layout} (needs linear or swizzled_128x4)" in reasons
    assert all(GRAMMAR.match(r) for r in reasons), reasons
