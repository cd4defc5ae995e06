"""The maintained benchmarks' CPU smoke modes: every Python path of bench_public_op.py and of the
launch-table tuner (tune_launch_table.py) runs (Triton interpreter, tiny shapes, a stand-in
FlashInfer), so the scripts cannot rot between GPU runs."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from arnorm.plugin import FORMAT_SPECS

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]

#: A stand-in for flashinfer.norm's two single-GPU fused kernels the benchmark compares against.
FAKE_NORM = """
import torch


def _norm(x, r, w, eps):
    r.copy_((x.float() + r.float()).to(r.dtype))
    hf = r.float()
    return hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps) * w.float()


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    input.copy_(_norm(input, residual, weight, eps).to(input.dtype))


def fused_add_rmsnorm_quant(out, input, residual, weight, scale, eps=1e-6, enable_pdl=None):
    out.copy_((_norm(input, residual, weight, eps) / scale).clamp(-448, 448).to(out.dtype))
"""


def _run(script: str, tmp_path: pathlib.Path, *extra: str) -> tuple[object, pathlib.Path]:
    fake = tmp_path / "fi" / "flashinfer"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.0-fake"\n')
    (fake / "norm.py").write_text(FAKE_NORM)
    out = tmp_path / "out"
    env = dict(os.environ, TRITON_INTERPRET="1", OUT="")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fi"), str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def test_bench_public_op_smoke(tmp_path):
    """--smoke runs every section (eager breakdown, graph rows for every format, PDL off, FlashInfer
    rows and verdicts) and writes the markdown and JSON tables without an error row."""
    _, out = _run("bench_public_op.py", tmp_path)
    (md,) = out.glob("public-op-*.md")
    (js,) = out.glob("public-op-*.json")
    text = md.read_text()
    assert "flashinfer 0.0-fake" in text and "Smoke run on CPU" in text
    assert "Error:" not in text and "Skipped:" not in text and "FAIL" not in text
    for needle in ("launcher, outputs preallocated", "flashinfer (output preallocated)", "its fast path",
                   "out=, pdl off", "fi_fused_add_rmsnorm_quant", "pdl off", "x fi "):  # fmt: skip
        assert needle in text, needle
    for fmt in ("none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"):
        assert f"| {fmt} | no |" in text or fmt == "none", fmt
        assert f"| {fmt} | yes |" in text, fmt
    assert js.stat().st_size > 0


def test_make_op_honours_inplace_and_layout(monkeypatch):
    """bench_public_op.make_op builds the op the benchmarks ask for: in place by default (the new residual
    over hidden_states, swizzled nvfp4 scales), a buffer of its own with inplace=False, and the
    scale layout that layout= names."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from bench_public_op import CpuDevice, Inputs, make_op

    dev = CpuDevice()
    inp = Inputs(dev, 5, 64, "nvfp4")
    for inplace, layout, want_layout, want_shape in ((True, None, "swizzled_128x4", (128, 4)),
                                                    (False, "linear", "linear", (5, 4))):  # fmt: skip
        op = make_op(dev, 64, "nvfp4", False, max_tokens=8, inplace=inplace, layout=layout)
        x = inp.x.clone()
        out = op(x, inp.r, inp.w, inp.scale)
        assert (out.residual.data_ptr() == x.data_ptr()) is inplace
        assert torch.equal(x, inp.x) is not inplace
        assert (out.quant.layout, tuple(out.quant.scale.shape)) == (want_layout, want_shape)
        op.close()


def test_bench_batch_invariant_smoke(tmp_path):
    """--smoke times both modes for each cell, checks a batch's first row against the row alone, and
    writes the table with the ratio column and no error row."""
    _, out = _run("bench_batch_invariant.py", tmp_path)
    (md,) = out.glob("batch-invariant-*.md")
    assert list(out.glob("batch-invariant-*.json"))
    text = md.read_text()
    assert "Smoke run on CPU" in text and "errors:" not in text and "skipped:" not in text, text
    assert "| 256 | none | 3 |" in text and "| 256 | fp8_per_token | 1 |" in text, text
    assert "invariant mode rows not bitwise alone: 0 (needs 0)" in text, text


def test_tune_launch_table_smoke(tmp_path):
    """The tuner of the shipped launch table: --smoke compiles every candidate in worker processes,
    times them, and writes a launch-table module that imports and has the table's key and row
    shapes, keyed on the format table's codes; the tree's table is untouched."""
    before = (REPO / "arnorm_triton" / "_launch_measured.py").read_text()
    _, out = _run("tune_launch_table.py", tmp_path)
    assert "Error:" not in (next(out.glob("launch-table-*.md"))).read_text()
    scope: dict = {}
    exec((out / "_launch_measured.py").read_text(), scope)
    for key, rows in scope["MEASURED"].items():
        assert len(key) == 5 and isinstance(key[3], bool)
        assert key[2] in {0, *(spec.code for spec in FORMAT_SPECS.values())}
        assert all(t_max >= 1 and warps >= 1 for t_max, warps in rows)
        assert [t for t, _ in rows] == sorted(t for t, _ in rows)
    assert (REPO / "arnorm_triton" / "_launch_measured.py").read_text() == before


def test_gpu_formats_smoke(tmp_path):
    """gpu_formats.py --smoke runs both sections (exact against reference, batch-invariant rows) on
    CPU and finds nothing different."""
    proc, _ = _run("gpu_formats.py", tmp_path)
    assert "# ALL EXACT AND BATCH-INVARIANT" in proc.stdout
    assert proc.stdout.count("exact  ") >= 16 and proc.stdout.count("rows   ") == 4
