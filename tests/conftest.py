"""Shared fixtures; the Triton interpreter is enabled on machines without a CUDA GPU."""

from __future__ import annotations

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    # Read when each @triton.jit runs: set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip gpu / multigpu / rocm tests cleanly where the hardware is missing."""
    import torch

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    is_rocm = bool(getattr(torch.version, "hip", None))
    skips = {
        "gpu": (n_gpu >= 1 and not is_rocm, "needs a CUDA GPU"),
        "multigpu": (n_gpu >= 2 and not is_rocm, "needs two or more CUDA GPUs"),
        "rocm": (n_gpu >= 1 and is_rocm, "needs a ROCm GPU"),
    }
    for item in items:
        for mark, (ok, why) in skips.items():
            if mark in item.keywords and not ok:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test starts from the entry-point registry, whatever the previous test installed."""
    from arnorm.registry._discovery import reset_registry

    reset_registry()
    yield
    reset_registry()


@pytest.fixture
def clean_env(monkeypatch):
    """No ARNORM_* variable leaks into a test."""
    for key in list(os.environ):
        if key.startswith("ARNORM_"):
            monkeypatch.delenv(key)
    return monkeypatch


@pytest.fixture
def fastpath(clean_env):
    """The fastpath backend (tests/fake_backends.py) installed with fresh records and defaults."""
    import fake_backends as fb

    B = fb.FastPathBackend
    B.fast_calls, B.slow_calls, B.decline, B.fast_path_error = [], [], False, None
    fb.install(fb.spec("fastpath", 50, "FastPathBackend", caps=fb.WRITES_OUT))
    yield B
    B.decline, B.fast_path_error = False, None
