"""``AiterBackend.probe``: reasons, never an import of aiter (it JIT-builds, spawns, may SystemExit)."""

from __future__ import annotations

import sys

import pytest
import torch
from aiter_fake import HIP, problem

from arnorm_aiter import _rules
from arnorm_aiter._backend import AiterBackend

FNUZ = "quant: fp8_per_token on gfx942 (needs gfx950: gfx942 writes e4m3fnuz, max 240, not arnorm's e4m3fn)"


class _NoAiter:
    """A meta-path finder that fails the test on any attempt to import aiter."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name == "aiter" or name.startswith("aiter."):
            self.attempts.append(name)
            raise AssertionError(f"probe imported {name}")
        return None


@pytest.fixture
def no_aiter_import(monkeypatch):
    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        monkeypatch.delitem(sys.modules, name)
    finder = _NoAiter()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    yield finder
    assert finder.attempts == []


@pytest.mark.parametrize("hip", [None, ""])
def test_not_rocm_is_a_reason_not_an_import(no_aiter_import, monkeypatch, hip):
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(_rules, "installed_version", lambda: pytest.fail("read aiter's version off ROCm"))
    for prob in (problem(), problem(platform="cuda", gfx_arch=None), problem(platform="cpu", gfx_arch=None)):
        reasons = AiterBackend.probe(prob)
        assert reasons == (f"platform: torch {torch.__version__} without ROCm (needs a ROCm build of torch)",)


def test_rocm_reads_metadata_and_never_imports(no_aiter_import, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", HIP, raising=False)
    monkeypatch.setattr(_rules, "installed_version", lambda: "0.1.20.post1")
    assert AiterBackend.probe(problem()) == ()
    assert AiterBackend.probe(problem(weight_offset=1.0, quant="fp8_per_token")) == ()
    monkeypatch.setattr(_rules, "installed_version", lambda: "0.1.16")
    reasons = AiterBackend.probe(problem(weight_offset=1.0, gfx_arch="gfx942", quant="fp8_per_token"))
    assert reasons == (
        "aiter version: 0.1.16 (needs >= 0.1.19.post1: older 1-stage kernels lack their final cross-rank "
        "barrier, ROCm/aiter#4346)",
        "aiter version: 0.1.16 (needs >= 0.1.17 for a Gemma norm: gemma_norm)",
        "aiter version: 0.1.16 (needs >= 0.1.18 for fp8_per_token with normed_output: emit_bf16)",
        FNUZ,
    )


def test_probe_through_selection_lists_the_reasons(monkeypatch):
    """The core's local check (capabilities, then probe) shows aiter's reasons verbatim."""
    from aiter_fake import install, use_registry

    from arnorm.registry._discovery import get_registry
    from arnorm.registry._select import Preference, check_locally

    install(monkeypatch, version="0.1.20")
    use_registry()
    assert get_registry().get("aiter").status == "available"  # the fake is importable
    auto = Preference(None, "auto")
    verdicts = check_locally(problem(gfx_arch="gfx942", quant="fp8_per_token"), get_registry(), auto)
    assert (verdicts["aiter"].status, verdicts["aiter"].reasons) == ("incompatible", (FNUZ,))
    assert verdicts["reference"].status == "eligible"
    assert check_locally(problem(), get_registry(), auto)["aiter"].status == "eligible"
    six = check_locally(problem(world_size=6), get_registry(), auto)["aiter"]
    assert six.reasons == ("world size: 6 (needs 2, 4 or 8)",)
    offset = check_locally(problem(weight_offset=0.5), get_registry(), auto)["aiter"]
    assert offset.reasons == ("weight offset: 0.5 (needs 0 or 1)",)


@pytest.mark.parametrize("fmt", ["fp8_per_group", "fp8_per_group_64_ue8m0", "mxfp4"])
def test_the_group_formats_and_mxfp4_are_declined_saying_why(fmt):
    """Not declared (docs/numerics.md 3.6: its mxfp4 rounds e2m1 ties up; its per-group epilogue is
    not served with Gemma): one reason in the grammar, naming the format."""
    from arnorm.registry._capabilities import check_capabilities
    from arnorm_aiter._plugin import CAPABILITIES

    reasons = check_capabilities(CAPABILITIES, problem(quant=fmt, scale_layout="linear"))
    assert any(r.startswith(f"quant: {fmt} (needs ") for r in reasons), reasons
