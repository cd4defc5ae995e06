"""The triton_symm GPU round's scripts, checked on CPU: the shell script parses, the entry-point patch
works on a dist-info without the line, and the precompile list covers what the GPU tests build."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "lab" / "gpu_symm_round.sh"


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
    (dist / "entry_points.txt").write_text("[arnorm.backends]\nreference = arnorm.registry._builtin\n")
    # The temporary dist-info comes first on the child's path, so importlib.metadata picks it.
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}]\n{snippet}"
    run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "added to" in run.stdout
    content = (dist / "entry_points.txt").read_text()
    assert content.count("triton_symm = arnorm_triton.symm._plugin") == 1
    run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert "registered" in run.stdout


def test_precompile_covers_the_gpu_tests_and_the_conformance_cases():
    """Every configuration test_symm_gpu.py builds and every conformance case at TP 2 and 4 is in the
    precompile list, so the GPU tests start from Triton's cache."""
    sys.path.insert(0, str(ROOT / "lab"))
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
            rbw = "round_before_weight" in c.norm_options
            assert (c.dtype, c.quant, c.layout, c.hidden, True, rbw, world) in configs


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run")
@pytest.mark.parametrize(("quant", "world"), [(None, 2), ("fp8_static", 2), ("nvfp4", 2), ("fp8_static", 4)])
def test_self_push_runs_the_protocol(quant, world):
    """The benchmark's `push self` backend (rank 0 of a world whose peers are all itself) pushes into
    its own slots of the other ranks, finds the rows there and sums them: its result is the
    reference of partials [x] * world, and its slots hold the sentinel again after each call."""
    from triton_cases import check_output, make_problem, make_scale

    from arnorm.plugin import add_rmsnorm, rank_order_sum
    from arnorm_triton.symm._workspace import SENTINEL_BYTE

    sys.path.insert(0, str(ROOT / "lab"))
    try:
        import check_triton_symm
    finally:
        sys.path.pop(0)
    h = 64
    problem = make_problem(h, torch.bfloat16, quant, world_size=1, max_tokens=8)
    cpu = torch.device("cpu")
    backend = check_triton_symm._self_push(problem, slots=world, pdl=False, device=cpu, world=world)
    ws = backend._ws
    for call, t in enumerate((1, 3, 2, 5)):  # both slot parities, and programs with several rows
        g = torch.Generator().manual_seed(call)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        res = torch.randn(t, h, generator=g).to(torch.bfloat16)
        w = (torch.randn(h, generator=g) * 0.1 + 1.0).to(torch.bfloat16)
        s = rank_order_sum([x] * world)
        scale = make_scale(quant, add_rmsnorm(s, res, w, 1e-6, 0.0)[1])
        out = backend(x.clone(), res, w, scale)
        backend.check()
        check_output(out, s, res, w, problem, scale)
    assert bool((ws.buffer[ws.layout.push_off :] == SENTINEL_BYTE).all())
