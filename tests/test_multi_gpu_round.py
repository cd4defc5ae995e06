"""The multi-GPU round (benchmarks/gpu_multi_round.sh and its Python steps) cannot rot between the
rare sessions that lend several GPUs: the shell parses, the job order and GPU groups, the merged
table and its target lines, the fault verdicts, and (slow) a CPU dry run of the timed step and of
the fault script."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import multi_gpu_faults as faults  # noqa: E402
import multi_gpu_round as rnd  # noqa: E402


def test_the_round_script_parses_and_the_docs_name_it():
    subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_multi_round.sh")], check=True)
    assert not (REPO / "benchmarks" / "gpu_two_gpu_round.sh").exists()
    for doc in ("docs/performance.md", "benchmarks/results/README.md"):
        assert "benchmarks/gpu_multi_round.sh" in (REPO / doc).read_text(), doc


def test_gpu_blocks_are_aligned_and_exclusive():
    assert rnd._block(set(range(8)), 2, 8) == [0, 1]
    assert rnd._block({2, 3, 4, 5, 6, 7}, 4, 8) == [4, 5, 6, 7]
    assert rnd._block({1, 2, 3, 4, 5, 6, 7}, 8, 8) is None
    assert rnd._block(set(), 0, 2) == []


def _opts(gpus, **kw):
    base = dict(
        out="/tmp", gpus=gpus, tps=[2, 4, 8], budget=100, deadline=None, dry_run=False, max_configs=None
    )
    return types.SimpleNamespace(**{**base, **kw})


def test_jobs_cover_every_tp_up_to_the_gpus_in_order_of_worth():
    jobs = rnd.Round(_opts(8)).bench_jobs()
    names = [j.name for j in jobs]
    assert names[:4] == [
        "bench-tp2-h8192-none-symm",
        "bench-tp4-h8192-none-symm",
        "bench-tp8-h8192-none-symm",
        "bench-tp8-h8192-none-nopush",
    ]
    assert sum(n.endswith("-symm") for n in names) == sum(n.endswith("-fi") for n in names) == 18
    fi = [j for j in jobs if j.after_build]
    assert fi[0].name == "tests-multigpu-flashinfer" and all(not j.after_build for j in jobs[: -len(fi)])
    nopush = jobs[3]
    assert nopush.env["ARNORM_TRITON_SYMM_PUSH_MAX_TOKENS"] == "0" and "1,16" in nopush.cmd
    for j in jobs:
        if j.name.startswith("bench"):
            assert ("flashinfer" in j.env.get("ARNORM_DISABLE", "")) == (not j.after_build), j
            assert j.gpus == int(j.name.split("-")[1][2:]) and "--device" in j.cmd
    two = [j.name for j in rnd.Round(_opts(2)).bench_jobs()]
    assert not any("tp4" in n or "tp8" in n for n in two) and two[-1] == "tests-multigpu-flashinfer"


def _report(path, tp, hidden, quant, rows, rejected=None):
    results = [
        {"backend": b, "tokens": t, "median_us": us, **({"picked": picked} if picked else {})}
        for b, t, us, picked in rows
    ]
    rep = {"tp": tp, "hidden": hidden, "quant": None if quant == "none" else quant, "results": results}
    path.write_text(json.dumps({**rep, "rejected": rejected or {}}))


def test_the_merged_table_holds_every_part_and_says_the_targets(tmp_path):
    symm = [("baseline", 1, 30.0, None), ("triton_symm", 1, 4.0, None), ("triton", 1, 9.0, None)]
    _report(tmp_path / "bench-tp2-h8192-none-symm.json", 2, 8192, "none", symm)
    fi = [("baseline", 1, 31.0, None), ("flashinfer", 1, 5.0, None), ("auto", 1, 4.5, "triton_symm")]
    _report(tmp_path / "bench-tp2-h8192-none-fi.json", 2, 8192, "none", fi)
    why = {"status": "incompatible", "reasons": ["quant: nvfp4 on SM 9.0 (needs SM 10.0+)"]}
    _report(tmp_path / "bench-tp2-h8192-nvfp4-fi.json", 2, 8192, "nvfp4",
            [("baseline", 1, 40.0, None), ("auto", 1, 6.0, "triton_symm")], {"flashinfer": why})  # fmt: skip
    _report(tmp_path / "bench-tp8-h8192-none-symm.json", 8, 8192, "none",
            [("baseline", 1, 50.0, None), ("triton_symm", 1, 7.0, None)])  # fmt: skip
    _report(tmp_path / "bench-tp8-h8192-none-nopush.json", 8, 8192, "none",
            [("baseline", 1, 50.0, None), ("triton_symm", 1, 8.0, None)])  # fmt: skip
    text = rnd.summarize(tmp_path)
    row = (
        "| 2 | 8192 | none | 1 | 30.00 | 4.00 | 9.00 | 5.00 | 4.50 | - | triton_symm | triton_symm | 1.125 |"
    )
    assert row in text
    assert "- TP 2, T 1, H 8192, none: triton_symm 4.00 us (target <= 4.5)" in text
    assert "TP 2 H 8192 none T 1: 0.80x" in text
    assert "auto within 3% of the fastest: TP 2 H 8192 none T 1: auto 1.125x of triton_symm" in text
    assert "TP 2 H 8192 nvfp4: flashinfer not timed (incompatible): quant: nvfp4 on SM 9.0" in text
    assert "T 1: push 7.00 us, flags 8.00 us" in text


def test_fault_verdicts():
    fault = [{"phase": "built", "t_s": 1.0}, {"phase": "fault", "t_s": 2.0}]
    raised = [*fault, {"call": 3, "outcome": "raised", "error": "PeerError", "message": "rank 1", "t_s": 7.0}]
    assert faults.judge("kill", raised, True, 60)[0] == "ok"
    assert "PeerError: rank 1 at +5.0 s" in faults.judge("kill", raised, True, 60)[1]
    wrong = [
        *fault,
        {"call": 3, "outcome": "returned", "right": False, "t_s": 3.0},
        {"check": "clean", "t_s": 3.1},
    ]
    assert faults.judge("stall", wrong, True, 60)[0] == "SILENTLY WRONG"
    flagged = [*wrong[:-1], {"check": "raised", "error": "ArnormError", "message": "spin", "t_s": 3.1}]
    assert faults.judge("stall", flagged, True, 60)[0] == "ok"
    assert faults.judge("stall", fault, False, 60)[0] == "UNBOUNDED"
    failed = [
        {"phase": "build", "t_s": 0.1},
        {"phase": "build failed", "error": "X", "message": "m", "t_s": 0.2},
    ]
    assert faults.judge("kill", failed, True, 60)[0] == "NOT RUN"
    assert faults.judge("stall_build", failed, True, 60)[0] == "ok"


def test_the_peer_timeout_setting_is_read_from_config_whatever_its_name(monkeypatch):
    import arnorm

    monkeypatch.setattr(
        arnorm, "Config", types.SimpleNamespace(model_fields={"backend": 0, "peer_wait_timeout": 0})
    )
    assert faults.peer_timeout_setting() == ("ARNORM_PEER_WAIT_TIMEOUT", "Config.peer_wait_timeout")
    monkeypatch.setattr(arnorm, "Config", types.SimpleNamespace(model_fields={"backend": 0}))
    var, why = faults.peer_timeout_setting()
    assert var is None and why.startswith("arnorm.Config: no peer-timeout field (needs ")


def _env():
    path = os.pathsep.join(
        [str(REPO), str(REPO / "backends" / "arnorm-example"), os.environ.get("PYTHONPATH", "")]
    )
    return dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1", ARNORM_DISABLE="triton")


@pytest.mark.slow
def test_dry_run_of_the_timed_step(tmp_path):
    """Both bench parts of one (H, quant) on CPU, FlashInfer absent: its reason in the merged table."""
    (tmp_path / "fi-build.log").write_text("flashinfer: not installed (ModuleNotFoundError: x)\n")
    (tmp_path / "fi-build.log.done").write_text("")
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "multi_gpu_round.py"),
        "run",
        "--dry-run",
        "--steps",
        "timed",
    ]
    cmd += ["--max-configs", "1", "--out", str(tmp_path), "--budget", "200"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "bench-tp2-h256-none-symm: " in summary and "bench-tp2-h256-none-fi: " in summary
    assert "not run" not in summary, summary
    merged = (tmp_path / "bench-summary.md").read_text()
    assert "| 2 | 256 | none | 1 |" in merged and "flashinfer not timed (not_installed)" in merged


@pytest.mark.slow
def test_dry_run_of_the_fault_script(tmp_path):
    """A killed rank and a stalled one over gloo: rank 0 ends within the bound, never silently wrong."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "multi_gpu_faults.py"), "--device", "cpu"]
    cmd += [
        "--scenarios",
        "kill,stall",
        "--stall",
        "2",
        "--bound",
        "40",
        "--pg-timeout",
        "10",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "faults.json").read_text())["results"]
    assert [(r["scenario"], r["verdict"]) for r in results] == [("kill", "ok"), ("stall", "ok")]
    assert "call 3: " in results[0]["seen"]  # the peer saw its dead rank at the next call
