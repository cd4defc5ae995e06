"""The aiter entry point: its descriptor, its registration, and that nothing heavy is imported early."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from aiter_fake import problem, use_registry

import arnorm
from arnorm.plugin import check_capabilities
from arnorm_aiter._plugin import CAPABILITIES, arnorm_backends


def test_descriptor_fields():
    (spec,) = arnorm_backends()
    assert (spec.name, spec.priority, spec.extra, spec.distribution) == ("aiter", 200, "aiter", "amd-aiter")
    assert spec.loader == "arnorm_aiter._backend:AiterBackend"
    assert spec.requires == ("aiter",)
    assert spec.capabilities == CAPABILITIES
    assert spec.min_version == "0.1.19.post1"
    # The public index's aiter is too old: the hint says where a usable one comes from.
    assert spec.fix_hint() == "a build of ROCm/aiter at v0.1.19.post1 or later, see docs/aiter.md"


def test_entry_point_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["entry-points"]["arnorm.backends"]["aiter"] == "arnorm_aiter._plugin"
    assert project["optional-dependencies"]["aiter"] == ["amd-aiter>=0.1.19.post1"]
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="arnorm.backends")}
    if "aiter" not in installed:
        pytest.skip("the installed metadata predates the aiter entry point (reinstall: pip install -e .)")
    assert installed["aiter"] == "arnorm_aiter._plugin"


@pytest.mark.skipif(importlib.util.find_spec("aiter") is not None, reason="aiter is installed here")
def test_listed_quietly_as_not_installed():
    use_registry()
    info = {b.name: b for b in arnorm.backends()}["aiter"]
    assert info.status == "not_installed"
    assert (
        info.reason
        == "not installed: aiter (needs a build of ROCm/aiter at v0.1.19.post1 or later, see docs/aiter.md)"
    )


def test_an_installed_aiter_below_the_floor_is_outdated_with_its_version(monkeypatch):
    """An aiter older than 0.1.19.post1 (the public index's 0.1.7) is listed as outdated, not available."""
    import importlib.metadata as md

    from arnorm.registry._discovery import Registry

    real_version = md.version
    monkeypatch.setattr(md, "version", lambda d: "0.1.7.post2.dev18" if d == "amd-aiter" else real_version(d))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "aiter" else None)
    registry = Registry()
    registry.add_from_hook("aiter", arnorm_backends)
    info = registry.get("aiter")
    assert info.status == "outdated"
    assert info.reason.startswith("version: amd-aiter 0.1.7.post2.dev18 (needs >= 0.1.19.post1")


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({}, None),
        ({"platform": "cuda"}, "platform: cuda (needs rocm)"),
        ({"dtype": "float32"}, "dtype: float32 (needs bfloat16 or float16)"),
        ({"quant": "fp8_static"}, "quant: fp8_static (needs fp8_per_token or none)"),
        ({"quant": "nvfp4", "scale_layout": "linear"}, "quant: nvfp4 (needs fp8_per_token or none)"),
        ({"world_size": 6}, "world size: 6 (needs 2, 4 or 8)"),
        ({"world_size": 16}, "world size: 16 (needs 2, 4 or 8)"),
        ({"hidden_size": 4100}, "hidden size: 4100 (needs a multiple of 8)"),
        ({"hidden_size": 16392}, "hidden size: 16392 (needs <= 16384)"),
    ],
)
def test_declared_capabilities(overrides, reason):
    reasons = check_capabilities(CAPABILITIES, problem(**overrides))
    assert reasons == (() if reason is None else (reason,))


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_plugin_module_is_cheap():
    mods = _imported_after("import arnorm_aiter._plugin")
    assert "torch" not in mods
    assert not any(m == "aiter" or m.startswith("aiter.") for m in mods)
    assert "arnorm_aiter._backend" not in mods


def test_backend_module_never_imports_aiter():
    mods = _imported_after("import arnorm_aiter._backend")
    assert not any(m == "aiter" or m.startswith("aiter.") for m in mods)
