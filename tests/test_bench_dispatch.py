"""benchmarks/bench_dispatch.py runs (a few calls, no timing claims), so the script cannot rot."""

from __future__ import annotations

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_dispatch  # noqa: E402

from arnorm.testing import registered  # noqa: E402


@pytest.mark.parametrize("backend", ["dispatch_stub", "dispatch_stub_fast"])
@pytest.mark.parametrize("quant", [None, "fp8_static"])
def test_the_stubs_serve_the_op(backend, quant):
    with registered(*bench_dispatch.SPECS):
        t_op, t_direct = bench_dispatch.measure(quant, backend, number=20, repeat=1)
    assert t_op > 0 and t_direct > 0
