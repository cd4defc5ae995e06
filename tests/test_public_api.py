"""The public surface: names, import cost, errors."""

from __future__ import annotations

import subprocess
import sys

import arnorm


def test_all_lists_exactly_the_public_names():
    """__all__ names every public attribute of the package and nothing else."""
    import types

    public = sorted(
        n
        for n, v in vars(arnorm).items()
        if not n.startswith("_") and n != "annotations" and not isinstance(v, types.ModuleType)
    )
    assert sorted(arnorm.__all__) == public


def test_design_names_exist():
    """Every name docs/architecture.md and the README fix is exported."""
    for name in (
        "RMSNorm",
        "AllReduceNorm",
        "fused_allreduce_norm",
        "Output",
        "QuantizedActivation",
        "FusedAllReduceNorm",
        "Capabilities",
        "Config",
        "backends",
        "Explanation",
        "ArnormError",
    ):
        assert name in arnorm.__all__


def test_import_pulls_no_torch_and_scans_no_entry_points():
    """`import arnorm` imports neither torch nor a backend, and does not discover plugins."""
    code = (
        "import sys, importlib.metadata as md\n"
        "calls = []\n"
        "orig = md.entry_points\n"
        "md.entry_points = lambda *a, **k: calls.append(k.get('group')) or orig(*a, **k)\n"
        "import arnorm, arnorm.registry._discovery as d\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'flashinfer', 'aiter',"
        " 'arnorm_triton', 'arnorm_flashinfer', 'arnorm_aiter', 'numpy')]\n"
        "print(heavy, [c for c in calls if c and c.startswith('arnorm')], d._registry)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] [] None"


def test_errors_subclass_matching_builtins():
    """Each arnorm error is also the built-in a caller would naturally catch."""
    assert issubclass(arnorm.InvalidInputError, ValueError)
    assert issubclass(arnorm.ConfigError, ValueError)
    assert issubclass(arnorm.BackendNotInstalledError, ImportError)
    assert issubclass(arnorm.BackendBrokenError, ImportError)
    assert issubclass(arnorm.NoEligibleBackendError, RuntimeError)
    assert issubclass(arnorm.BackendSetupError, RuntimeError)
    assert issubclass(arnorm.PeerError, RuntimeError)
    for name in arnorm.__all__:
        obj = getattr(arnorm, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, arnorm.ArnormError), name


def test_rmsnorm_is_frozen_hashable_and_validated():
    """RMSNorm is an immutable value; a bad eps names the argument."""
    import dataclasses

    import pytest

    n = arnorm.RMSNorm(1e-5, 1.0)
    assert hash(n) == hash(arnorm.RMSNorm(1e-5, 1.0)) and n.kind == "gemma"
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.eps = 1.0  # type: ignore[misc]
    with pytest.raises(arnorm.InvalidInputError, match=r"eps: -1 \(needs a positive finite float\)"):
        arnorm.RMSNorm(eps=-1)
