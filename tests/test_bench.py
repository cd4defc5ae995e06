"""`arnorm bench`: the table, the raw JSON, the plot, and backends that cannot be timed."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import pytest

import arnorm
from arnorm import _bench
from arnorm._cli import main

HAS_PLOT = importlib.util.find_spec("matplotlib") is not None
TOKENS = (1, 8)


def _names() -> list[str]:
    return [n for n in ("reference", "example") if n in {i.name for i in arnorm.backends()}]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One real 2-rank gloo run shared by the tests below: (exit status, stdout, json path, png path)."""
    out_dir = tmp_path_factory.mktemp("bench")
    js, png = out_dir / "bench.json", out_dir / "bench.png"
    argv = ["bench", "--tp", "2", "--hidden", "64", "--tokens", "1,8", "--iters", "3", "--warmup", "1"]
    argv += ["--device", "cpu", "--backends", ",".join([*_names(), "flashinfer"]), "--json", str(js)]
    if HAS_PLOT:
        argv += ["--plot", str(png)]
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("ARNORM_")]:
            mp.delenv(key)
        with contextlib.redirect_stdout(buf):
            rc = main(argv)
    return rc, buf.getvalue(), js, png


@pytest.mark.slow
def test_table_has_every_backend_and_the_baseline_per_token_count(bench_run):
    """Each requested, eligible backend and the baseline has a timed row for every token count."""
    rc, out, _, _ = bench_run
    assert rc == 0, out
    rows = re.findall(
        r"^\|\s+(\d+) \| (\S+)\s+\|\s+([\d.]+) \| ([\d.]+)-([\d.]+)\s+\|\s+([\d.]+)x", out, re.M
    )
    seen = {(int(t), b) for t, b, *_ in rows}
    assert seen == {(t, b) for t in TOKENS for b in ("baseline", *_names())}
    assert all(float(lo) <= float(med) <= float(hi) for _, _, med, lo, hi, _ in rows)
    assert re.search(r"^auto mode picks: T=1: \S+, T=8: \S+$", out, re.M)


@pytest.mark.slow
def test_json_holds_every_sample(bench_run):
    """--json writes every sample: the slowest rank per iteration and each rank's own list."""
    _, _, js, _ = bench_run
    report = json.loads(js.read_text())
    assert (report["tp"], report["hidden"], report["tokens"], report["iters"]) == (2, 64, [1, 8], 3)
    points = {(r["backend"], r["tokens"]): r for r in report["results"]}
    assert set(points) == {(b, t) for t in TOKENS for b in ("baseline", *_names())}
    for r in points.values():
        assert len(r["samples_us"]) == 3 and len(r["rank_samples_us"]) == 2
        assert r["samples_us"] == [max(v) for v in zip(*r["rank_samples_us"], strict=True)]
        assert r["median_us"] == _bench.percentile(r["samples_us"], 50) > 0
    assert points[("baseline", 1)]["speedup"] == 1.0
    assert set(report["auto"]) == {"1", "8"}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PLOT, reason="pip install 'arnorm[plot]'")
def test_plot_writes_a_png(bench_run):
    """--plot writes a real PNG file of non-trivial size."""
    _, out, _, png = bench_run
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"wrote {png}" in out


@pytest.mark.slow
def test_ineligible_backend_is_reported_with_its_reason(bench_run):
    """A requested backend that cannot serve the problem is listed with its reason, not timed, no crash."""
    rc, out, js, _ = bench_run
    line = re.search(r"^not timed: flashinfer: (.+)$", out, re.M)
    assert rc == 0 and line and "(needs " in line.group(1)
    assert not re.search(r"^\|\s+\d+ \| flashinfer ", out, re.M)
    assert json.loads(js.read_text())["rejected"]["flashinfer"] == [line.group(1)]


def test_default_backends_are_the_locally_eligible_ones(clean_env):
    """Without --backends the bench times exactly what a local explain finds eligible, by priority."""
    problem = _bench.make_problem(2, 64, "bfloat16", None, 8, cuda=False)
    names, rejected = _bench.select_backends(problem, None)
    assert "reference" in names and names[-1] == "reference" and "flashinfer" not in names
    assert rejected == {}
    names, rejected = _bench.select_backends(problem, ["nosuch", "reference"])
    assert names == ["reference"] and "registry: no backend named 'nosuch'" in rejected["nosuch"][0]


def test_plot_without_matplotlib_exits_2(monkeypatch, capsys):
    """--plot without matplotlib says how to install it and exits 2 before spawning anything."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    assert main(["bench", "--plot", "x.png"]) == 2
    assert "pip install 'arnorm[plot]'" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys):
    """Malformed --tokens or a non-positive --iters is a usage error naming the argument."""
    assert main(["bench", "--tokens", "1,x"]) == 2
    assert "tokens: '1,x'" in capsys.readouterr().err
    assert main(["bench", "--iters", "0"]) == 2
    assert "--iters" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_in_process_under_torchrun(tmp_path):
    """Under torchrun each rank benches in-process and only rank 0 prints the table."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARNORM_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "arnorm"]
    cmd += ["bench", "--hidden", "64", "--tokens", "1", "--iters", "2", "--backends", "reference"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("arnorm bench: tp=2 hidden=64") == 1
    assert re.search(r"^\|\s+1 \| reference ", proc.stdout, re.M)
