"""`arnorm bench`: the table, the raw JSON, the plot, backends that cannot be timed, and GPU graph timing."""

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
from arnorm.cli import _bench, _bench_report
from arnorm.cli._main import main
from arnorm.plugin import Capabilities
from arnorm.registry._discovery import Registry, reset_registry
from arnorm.registry._spec import BackendSpec, priority_order

HAS_PLOT = importlib.util.find_spec("matplotlib") is not None
TOKENS = (1, 8)


def _named(name: str) -> type:
    """The reference backend under another name (a loaded class must carry its registered name)."""
    from arnorm._reference import ReferenceBackend

    cls = type(name.title(), (ReferenceBackend,), {"name": name, "__module__": __name__})
    globals()[cls.__name__] = cls
    return cls


def _names() -> list[str]:
    return [n for n in ("reference", "example") if n in {i.name for i in arnorm.backends()}]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One real 2-rank gloo run shared by the tests below: (exit status, stdout, json path, png path)."""
    out_dir = tmp_path_factory.mktemp("bench")
    js, png = out_dir / "bench.json", out_dir / "bench.png"
    argv = ["bench", "--tp", "2", "--hidden", "64", "--tokens", "1,8", "--iters", "3", "--warmup", "1"]
    argv += ["--device", "cpu", "--backends", ",".join([*_names(), "flashinfer", "auto"]), "--json", str(js)]
    if HAS_PLOT:
        argv += ["--plot", str(png)]
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("ARNORM_")]:
            mp.delenv(key)
        # Auto mode must pick a timed backend; triton under the interpreter is too slow to time here.
        mp.setenv("ARNORM_DISABLE", "triton")
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
    assert seen == {(t, b) for t in TOKENS for b in ("baseline", *_names(), "auto")}
    assert all(float(lo) <= float(med) <= float(hi) for _, _, med, lo, hi, _ in rows)
    assert re.search(r"^auto mode picks: T=1: \S+( \(not timed\))?, T=8: \S+( \(not timed\))?$", out, re.M)


@pytest.mark.slow
def test_json_holds_every_sample(bench_run):
    """--json writes every sample: the slowest rank per iteration and each rank's own list."""
    _, _, js, _ = bench_run
    report = json.loads(js.read_text())
    assert (report["tp"], report["hidden"], report["tokens"], report["iters"]) == (2, 64, [1, 8], 3)
    points = {(r["backend"], r["tokens"]): r for r in report["results"]}
    assert set(points) == {(b, t) for t in TOKENS for b in ("baseline", *_names(), "auto")}
    for r in points.values():
        assert len(r["samples_us"]) == 3 and len(r["rank_samples_us"]) == 2
        assert r["samples_us"] == [max(v) for v in zip(*r["rank_samples_us"], strict=True)]
        assert r["median_us"] == _bench_report.percentile(r["samples_us"], 50) > 0
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
@pytest.mark.skipif(not HAS_PLOT, reason="pip install 'arnorm[plot]'")
def test_plot_marks_the_backend_auto_mode_picks(bench_run):
    """The plot rings, per token count, the point of the backend auto mode runs; CPU says smoke test."""
    _, _, js, _ = bench_run
    report = json.loads(js.read_text())
    timed = _names()
    # Which backend auto mode picks here depends on what is installed: pin it to timed ones.
    report["auto"] = {str(t): timed[i % len(timed)] for i, t in enumerate(TOKENS)}
    ax = _bench_report.plot_figure(report).axes[0]
    (ring,) = [line for line in ax.get_lines() if line.get_gid() == "auto"]
    picks = {
        (r["tokens"], r["median_us"])
        for r in report["results"]
        if report["auto"][str(r["tokens"])] == r["backend"]
    }
    assert set(zip(ring.get_xdata(), ring.get_ydata(), strict=True)) == picks and len(picks) == len(TOKENS)
    assert "auto mode's pick" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert "smoke test" in ax.get_title()
    report["auto"] = {str(t): "not_timed_here" for t in TOKENS}  # a pick without a latency: no ring
    assert not [
        line for line in _bench_report.plot_figure(report).axes[0].get_lines() if line.get_gid() == "auto"
    ]


@pytest.mark.slow
def test_table_marks_auto_picks_and_says_when_one_was_not_timed(bench_run):
    """The auto column marks the picked row; a pick outside --backends is named as not timed."""
    _, _, js, _ = bench_run
    report = json.loads(js.read_text())
    report["auto"] = {"1": "reference", "8": "elsewhere"}
    table = _bench_report.render_table(report)
    assert re.search(r"^\|\s+1 \| reference\s+\|.*\| <- auto\s+\|$", table, re.M), table
    assert not re.search(r"^\|\s+8 \|.*<- auto", table, re.M), table
    assert "auto mode picks: T=1: reference, T=8: elsewhere (not timed)" in table.splitlines()


@pytest.mark.slow
def test_picks_are_labelled_by_what_chose_them(tmp_path, capsys):
    """Under ARNORM_BACKEND the marked op is that variable's choice, not auto mode's: said so in the
    JSON, the table (column, marker, summary line) and the plot's legend."""
    js = tmp_path / "bench.json"
    argv = ["bench", "--tp", "2", "--hidden", "64", "--tokens", "1", "--iters", "2", "--warmup", "1"]
    argv += ["--device", "cpu", "--backends", "reference", "--json", str(js)]
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("ARNORM_")]:
            mp.delenv(key)
        mp.setenv("ARNORM_BACKEND", "reference")
        assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(js.read_text())
    assert report["choice"] == "ARNORM_BACKEND" and report["auto"] == {"1": "reference"}
    assert re.search(r"^\| tokens \|.*\| ARNORM_BACKEND\s*\|$", out, re.M), out
    assert re.search(r"^\|\s+1 \| reference\s+\|.*\| <- ARNORM_BACKEND \|$", out, re.M), out
    assert "ARNORM_BACKEND picks: T=1: reference" in out.splitlines() and "auto mode" not in out
    if HAS_PLOT:
        legend = _bench_report.plot_figure(report).axes[0].get_legend().get_texts()
        assert "ARNORM_BACKEND's pick" in [t.get_text() for t in legend]


def test_auto_in_backends_times_the_auto_mode_op_and_names_what_it_ran(bench_run):
    """``--backends ...,auto`` times the op built without backend=: one row per token count, its
    auto column naming the backend selection ran there (the one auto mode picks), never 'unknown'."""
    _, out, js, _ = bench_run
    report = json.loads(js.read_text())
    assert "auto" not in report["rejected"] and "auto" in report["timed"]
    for t in TOKENS:
        (row,) = [r for r in report["results"] if r["backend"] == "auto" and r["tokens"] == t]
        assert row["samples_us"] and row["picked"] == report["auto"][str(t)], row
        assert re.search(rf"^\|\s+{t} \| auto\s+\|.*\| ran {row['picked']}\s+\|$", out, re.M), out


def test_auto_is_kept_in_place_and_not_looked_up_as_a_backend(clean_env):
    """'auto' is not a registered backend: it is timed where it was named, the others checked as usual."""
    problem = _bench.make_problem(2, 64, "bfloat16", None, 8, cuda=False)
    names, rejected = _bench._timed_backends(problem, ["auto", "nosuch", "reference"])
    assert names == ["auto", "reference"] and set(rejected) == {"nosuch"}
    assert _bench._timed_backends(problem, ["auto"]) == (["auto"], {})


@pytest.mark.slow
def test_cpu_table_says_it_is_a_smoke_test(bench_run):
    """A CPU run says under its table that its numbers say nothing about GPU backends."""
    _, out, _, _ = bench_run
    assert _bench_report.SMOKE_TEST in out.splitlines()


@pytest.mark.slow
def test_ineligible_backend_is_reported_with_its_status_and_reason(bench_run):
    """A requested backend that cannot serve is listed with its verdict status and reasons, not timed."""
    rc, out, js, _ = bench_run
    line = re.search(r"^not timed: flashinfer \((\w+)\): (.+)$", out, re.M)
    assert rc == 0 and line and "(needs " in line.group(2)
    assert not re.search(r"^\|\s+\d+ \| flashinfer ", out, re.M)
    info = {i.name: i for i in arnorm.backends()}["flashinfer"]
    expected_status = "not_installed" if info.status == "not_installed" else "incompatible"
    assert json.loads(js.read_text())["rejected"]["flashinfer"] == {
        "status": expected_status,
        "reasons": [line.group(2)],
    }
    assert line.group(1) == expected_status


def test_default_backends_are_the_locally_eligible_ones(clean_env):
    """Without --backends the bench times exactly what a local explain finds eligible, by priority."""
    problem = _bench.make_problem(2, 64, "bfloat16", None, 8, cuda=False)
    names, rejected = _bench.select_backends(problem, None)
    assert "reference" in names and names[-1] == "reference" and "flashinfer" not in names
    assert rejected == {}
    names, rejected = _bench.select_backends(problem, ["nosuch", "reference"])
    assert names == ["reference"] and rejected["nosuch"]["status"] == "unknown"
    assert "registry: no backend named 'nosuch'" in rejected["nosuch"]["reasons"][0]


def test_default_order_is_the_one_backend_order(clean_env):
    """Equal priorities are ordered by name, higher priorities first; ARNORM_DISABLE removes one."""
    any_platform = Capabilities(platforms=frozenset({"cpu", "cuda", "rocm"}))
    reg = Registry()
    for name, prio in (("reference", 0), ("zeta", 5), ("alpha", 5), ("top", 9), ("skipme", 7)):
        loader = f"{__name__}:{_named(name).__name__}"
        reg.add(BackendSpec(name=name, priority=prio, capabilities=any_platform, loader=loader))
    reset_registry(reg)
    clean_env.setenv("ARNORM_DISABLE", "skipme")
    problem = _bench.make_problem(2, 64, "bfloat16", None, 8, cuda=False)
    names, _ = _bench.select_backends(problem, None)
    assert names == sorted(
        ["reference", "zeta", "alpha", "top"], key=lambda n: priority_order(reg.get(n).priority, n)
    )
    assert names == ["top", "alpha", "zeta", "reference"]


def test_rejection_reads_the_verdict_not_the_message(clean_env):
    """A strict build that fails is described by its verdict's status and reasons from exc.explanation."""
    import torch

    with pytest.raises(arnorm.SelectionError) as info:
        arnorm.AllReduceNorm(
            arnorm.LOCAL, hidden_size=64, dtype=torch.bfloat16, norm=arnorm.RMSNorm(), backend="nosuch"
        )
    verdict = info.value.explanation.verdict("nosuch")
    assert _bench.rejection(info.value, "nosuch") == {
        "status": verdict.status,
        "reasons": list(verdict.reasons),
    }
    assert verdict.status == "unknown"
    bad = arnorm.InvalidInputError("hidden_size: 0 (needs a positive int)")
    assert _bench.rejection(bad, "x") == {"status": "error", "reasons": [f"InvalidInputError: {bad}"]}


def test_plot_without_matplotlib_exits_2(monkeypatch, capsys):
    """--plot without matplotlib says how to install it on one line and exits 2 before spawning anything."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    assert main(["bench", "--plot", "x.png"]) == 2
    assert (
        capsys.readouterr().err
        == "arnorm bench: error: --plot: needs matplotlib (pip install 'arnorm[plot]')\n"
    )


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_exits_2(capsys):
    """--device cuda where no GPU is visible is a one-line usage error."""
    assert main(["bench", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("arnorm bench: error: --device cuda: no CUDA device is visible")


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


@pytest.mark.slow
def test_notes_are_printed_under_the_table(bench_run):
    """A point timed another way than the rest (a capture that failed) says so under the table."""
    _, _, js, _ = bench_run
    report = json.loads(js.read_text())
    report["results"][0]["note"] = "CUDA-graph capture failed (RuntimeError: x): timed one call at a time"
    r = report["results"][0]
    lines = _bench_report.render_table(report).splitlines()
    assert f"T={r['tokens']} {r['backend']}: {r['note']}" in lines
    assert "one at a time (time.perf_counter)" in lines[0]


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gpu_points_are_timed_by_graph_replay(tmp_path, eager):
    """On a GPU every point is a CUDA-graph replay (restore copy measured and subtracted), unless --eager."""
    js = tmp_path / "bench.json"
    argv = ["bench", "--tp", "1", "--device", "cuda", "--tokens", "1,64", "--iters", "4", "--warmup", "1"]
    argv += ["--backends", "triton", "--json", str(js), *(["--eager"] if eager else [])]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0, buf.getvalue()
    report = json.loads(js.read_text())
    assert report["timing"] == ("CUDA events" if eager else "CUDA graphs")
    assert {(r["backend"], r["tokens"]) for r in report["results"]} == {
        (b, t) for b in ("baseline", "triton") for t in (1, 64)
    }
    for r in report["results"]:
        assert len(r["samples_us"]) == 4 and r["note"] is None, r
        assert ("rank_restore_us" in r) == (not eager)
        assert all(us > 0 for us in r["samples_us"]) and all(us > 0 for us in r.get("rank_restore_us", [1]))


def test_timeout_reaches_the_ranks_and_its_expiry_says_how_to_raise_it(monkeypatch, capsys):
    """--timeout bounds the spawned ranks (default 900 s: a first-use JIT build of a backend, such as
    FlashInfer's all-reduce module, takes minutes), and a run that outlives it exits 1 naming the
    option."""
    from arnorm.testing import _ranks

    seen = {}

    def expire(world, fn, *args, backend="gloo", env=None, timeout=180.0):
        seen["timeout"] = timeout
        raise _ranks.RankError(f"rank(s) [0, 1] did not finish within {timeout:g} s", timed_out=True)

    monkeypatch.setattr(_ranks, "run_ranks", expire)
    monkeypatch.setattr("arnorm.testing.run_ranks", expire)
    argv = ["bench", "--tp", "2", "--hidden", "64", "--tokens", "1", "--device", "cpu"]
    argv += ["--backends", "reference"]
    assert main([*argv, "--timeout", "42"]) == 1
    assert seen["timeout"] == 42
    err = capsys.readouterr().err
    assert "did not finish within 42 s" in err
    assert "--timeout" in err and "first use" in err
    assert main(argv) == 1
    assert seen["timeout"] == 900


@pytest.mark.slow
@pytest.mark.skipif("example" not in _names(), reason="needs the example plugin (backends/arnorm-example)")
def test_batch_invariant_mode_is_said_and_applied(monkeypatch, capsys):
    """Under ARNORM_BATCH_INVARIANT the header says so, and a named backend that does not declare
    the property is not timed, with the reason (the ops are built in that mode)."""
    for key in [k for k in os.environ if k.startswith("ARNORM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("ARNORM_BATCH_INVARIANT", "1")
    argv = ["bench", "--tp", "2", "--hidden", "64", "--tokens", "1", "--iters", "2", "--warmup", "1"]
    assert main([*argv, "--device", "cpu", "--backends", "reference,example"]) == 0
    out = capsys.readouterr().out
    assert "quant=none batch-invariant on cpu" in out.splitlines()[0], out
    assert "example (incompatible): batch invariance: not declared" in out, out
