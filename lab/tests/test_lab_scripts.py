"""The lab scripts' CPU smoke modes (not run by CI: ``pytest lab/tests``): the labs' Python paths
run (Triton interpreter, tiny shapes, a stand-in FlashInfer) when someone picks a lab up again."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

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
    cmd = [sys.executable, str(REPO / "lab" / script), "--smoke", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def test_bench_host_path_runs(tmp_path):
    """bench_host_path.py times every column for every format (a few calls each, no claims)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(REPO / "lab" / "bench_host_path.py"), "--number", "20", "--repeat", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert lines[0].startswith("| format | op call | op out= | fast path | core |")
    assert len(lines) == 6 and all(line.count("|") == lines[0].count("|") for line in lines)


def _lab(*variants: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(REPO / "lab" / "lab_kernel_variants.py"), "--smoke", *variants]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_lab_kernel_variants_smoke(tmp_path):
    """lab_kernel_variants.py builds and times each variant through the public op (also at fixed
    warp counts), exits 0 when every variant's outputs equal the first's, and exits 1 naming the
    cells of one that differs."""
    kernels = REPO / "arnorm_triton" / "_kernels.py"
    same = tmp_path / "same.py"
    same.write_text(kernels.read_text())
    off = tmp_path / "off.py"  # the weight shifted by one: every normed value moves
    text = kernels.read_text()
    assert text.count("SOFT) + weight_offset") == 1
    off.write_text(text.replace("SOFT) + weight_offset", "SOFT) + 2.0 * weight_offset + 1.0"))
    ok = _lab(f"cur={kernels}", f"same={same}")
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "| 64 | fp8_static | no | 3 |" in ok.stdout and "NOT EXACT" not in ok.stdout
    warps = _lab(f"cur={kernels}", "--warps", "4,8")
    assert warps.returncode == 0, warps.stdout[-2000:] + warps.stderr[-2000:]
    assert "| cur@4 | cur@8 |" in warps.stdout
    bad = _lab(f"cur={kernels}", f"off={off}")
    assert bad.returncode == 1 and "NOT EXACT" in bad.stdout and "differ" in bad.stderr


def test_lab_kernel_variants_two_pass_columns_run_their_own_variant(tmp_path):
    """lab_kernel_variants.py --two-pass times each variant's one- and two-pass columns with that
    variant's kernel module (they re-bind the launcher), not the first variant's; with
    --not-in-place too (ops whose new residual has a buffer of its own)."""
    kernels = REPO / "arnorm_triton" / "_kernels.py"
    off = tmp_path / "off.py"  # the weight shifted by one: every normed value moves
    text = kernels.read_text()
    off.write_text(text.replace("SOFT) + weight_offset", "SOFT) + 2.0 * weight_offset + 1.0"))
    run = _lab(f"cur={kernels}", f"off={off}", "--two-pass", "--not-in-place")
    assert "| cur | cur 1pass | cur 2pass | off | off 1pass | off 2pass |" in run.stdout, run.stdout[-2000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("| 64 | nvfp4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")][4:]
    assert ["NOT EXACT" in c for c in cells] == [False, False, False, True, True, True], row


def test_sass_census_counts_a_compiled_configuration():
    """sass_census.py compiles the fused kernel for sm_90 on a machine with no GPU and reports
    its instructions, barriers and registers (a reduction needs at least one barrier)."""
    import triton

    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tools.exists():
        pytest.skip(f"cuobjdump: not in this Triton ({tools})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(REPO / "lab" / "sass_census.py"), "--hidden", "1024", "--warps", "4",
           "--quant", "fp8_static", "--normed", "0"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 1024 |")]
    instructions, bars, _, registers = (int(x) for x in row.strip("| ").split(" | ")[4:])
    assert instructions > 100 and bars >= 1 and 0 < registers <= 255


def test_sass_census_counts_the_symm_kernel():
    """sass_census.py --symm compiles triton_symm's kernel at a world size and reports its warps,
    instructions, barriers, registers and stack bytes (the flag waits need barriers)."""
    import triton

    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tools.exists():
        pytest.skip(f"cuobjdump: not in this Triton ({tools})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(REPO / "lab" / "sass_census.py"), "--symm", "2", "--hidden", "1024",
           "--quant", "none"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 2 | 1024 |")]
    warps, instructions, bars, _, registers, stack = (int(x) for x in row.strip("| ").split(" | ")[3:])
    assert warps == 4 and instructions > 100 and bars >= 2 and 0 < registers <= 255 and stack >= 0


def test_lab_symm_variants_overlay_and_table(tmp_path):
    """lab_symm_variants.py runs a variant over a copy of arnorm_triton with the variant's kernel
    file in place (and its epilogue file when given), and tabulates the best time per cell."""
    sys.path.insert(0, str(REPO / "lab"))
    try:
        import lab_symm_variants as lab
    finally:
        sys.path.pop(0)
    variant = tmp_path / "v.py"
    variant.write_text("# variant\n")
    kernels = tmp_path / "k.py"
    kernels.write_text("# epilogue\n")
    path = lab.overlay(str(tmp_path / "o"), str(variant), str(kernels))
    pkg = pathlib.Path(path) / "arnorm_triton"
    assert (pkg / "_symm_kernels.py").read_text() == "# variant\n"
    assert (pkg / "_kernels.py").read_text() == "# epilogue\n"
    assert (pkg / "_symm_backend.py").read_text() == (REPO / "arnorm_triton" / "_symm_backend.py").read_text()
    rows = [
        {"variant": v, "hidden": 4096, "quant": "none", "tokens": 1, **dict.fromkeys(lab.columns((2, 8)), us)}
        for v, us in (("a", 2.0), ("a", 1.5), ("b", 3.0))
    ]
    rows[0]["self check"] = "push self: residual bitwise True"
    text = lab.table(rows, ["a", "b"], (2, 8))
    assert "| 4096 | none | 1 | 1.50 | 3.00 |" in text
    assert "| 8192 | fp8_static | 1 | - | - |" in text
    assert "- a: push self: residual bitwise True" in text
    assert "### push self W=8 (us per call)" in text


def test_lab_two_pass_smoke():
    """lab_two_pass.py --smoke builds every second-pass variant through the public op (Triton
    interpreter, a partial last tile) and finds each one's outputs equal to production's two-pass
    store, except the diagnostic handoff, which writes no scales."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(REPO / "lab" / "lab_two_pass.py"), "--smoke"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r.split("|")[1].strip(): r for r in proc.stdout.splitlines() if r.startswith("| ")}
    assert "NOT EXACT" in rows["handoff"]
    for name in ("prod", "1pass", "kc32", "kc128", "w1", "w8", "words"):
        assert rows[name].endswith("| checked |"), rows[name]


def test_lab_yardstick_smoke(tmp_path):
    """lab_yardstick.py --smoke checks every cell against the contract, times it beside copies of
    each size in interleaved rounds, and writes one bandwidth row per size and one fraction column
    per size for every cell."""
    _, out = _run("lab_yardstick.py", tmp_path)
    (md,) = out.glob("yardstick-*.md")
    text = md.read_text()
    assert "Smoke run on CPU" in text and "2 interleaved rounds" in text
    assert "| 16384 B |" in text and "| 65536 B |" in text
    rows = [r for r in text.splitlines() if r.startswith(("| nvfp4", "| fp8_static"))]
    assert len(rows) == 5, text
    for row in rows:
        assert "| ok |" in row and row.count("MISSED") + row.count("met") == 2, row
