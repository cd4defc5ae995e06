"""The triton_symm GPU round's scripts, checked on CPU: the shell script parses, the entry-point patch
works on a dist-info without the line, and the precompile list covers what the GPU tests build."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_symm_round.sh"


def test_round_script_parses():
    """bash -n accepts gpu_symm_round.sh."""
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_entry_point_patch_adds_the_line(tmp_path):
    """A wheel built before triton_symm existed gets the entry point added to its dist-info, once."""
    text = SCRIPT.read_text()
    snippet = re.search(r"python3 - <<'PY'.*?\n(.*?)\nPY\n", text, re.S).group(1)
    dist = tmp_path / "arnorm-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: arnorm\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[arnorm.backends]\nreference = arnorm._builtin\n")
    # The temporary dist-info comes first on the child's path, so importlib.metadata picks it.
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}]\n{snippet}"
    run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "added to" in run.stdout
    content = (dist / "entry_points.txt").read_text()
    assert content.count("triton_symm = arnorm_triton._symm_plugin") == 1
    run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert "registered" in run.stdout


def test_precompile_covers_the_gpu_tests_and_the_conformance_cases():
    """Every configuration test_symm_gpu.py builds and every conformance case at TP 2 and 4 is in the
    precompile list, so the GPU tests start from Triton's cache."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import check_triton_symm
    finally:
        sys.path.pop(0)
    import test_symm_gpu

    from arnorm.testing.conformance import ConformanceSuite

    class Suite(ConformanceSuite):
        backend = "triton_symm"

    configs = set(check_triton_symm._configs())
    assert set(test_symm_gpu.PRECOMPILE) <= configs
    assert test_symm_gpu.TestTritonSymmConformance.world_sizes == check_triton_symm.CONFORMANCE_WORLDS
    for c in Suite.cases():
        for world in (2, 4):
            assert (c.dtype, c.quant, c.layout, c.hidden, True, c.round_before_weight, world) in configs
