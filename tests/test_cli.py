"""The arnorm command line: backends, explain, doctor, demo."""

from __future__ import annotations

import re

import pytest

import arnorm
from arnorm._cli import main


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def test_backends_lists_every_registered_backend(capsys):
    """`arnorm backends` has a row per backend with priority, version, status and formats."""
    rc, out = run(capsys, "backends")
    assert rc == 0
    for info in arnorm.backends():
        assert re.search(rf"^{re.escape(info.name)}\s", out, re.M), info.name
    assert re.search(
        r"^reference\s+0\s+\S+\s+available\s+fp8_per_token,fp8_static,mxfp8,none,nvfp4\s+-$", out, re.M
    )


def test_explain_shows_choice_and_every_reason(capsys, clean_env):
    """`arnorm explain` names the backend it would pick and every other one's reasons, no collective."""
    rc, out = run(
        capsys, "explain", "--tp", "3", "--hidden", "4096", "--quant", "fp8_static", "--device", "cpu"
    )
    assert rc == 0
    assert "tp=3 hidden=4096 bfloat16 quant=fp8_static plain cpu" in out
    assert re.search(r"^reference\s+0\s+(selected|eligible)", out, re.M)
    for info in arnorm.backends():
        if info.status != "available":
            assert info.reason in out
    assert re.search(r"^  reference\s+fp8_per_token, fp8_static, mxfp8, none, nvfp4$", out, re.M)


def test_explain_strict_unservable_exits_nonzero(capsys, clean_env):
    """A strictly named backend that cannot serve makes explain exit 1 with its reason."""
    rc, out = run(
        capsys, "explain", "--tp", "2", "--quant", "nvfp4", "--backend", "example", "--device", "cpu"
    )
    if "registry: no backend named 'example'" in out:
        pytest.skip("the example plugin is not installed")
    assert rc == 1 and "quant: nvfp4 (needs fp8_per_token, fp8_static or none)" in out


def test_explain_rejects_bad_format_arguments(capsys):
    """A hidden size a format cannot take is an error naming the argument."""
    rc = main(["explain", "--quant", "mxfp8", "--hidden", "100"])
    err = capsys.readouterr().err
    assert rc == 2 and "hidden_size: 100" in err


def test_doctor_reports_machine_and_backends(capsys):
    """`arnorm doctor` shows python, torch, GPUs and each backend's status."""
    rc, out = run(capsys, "doctor")
    assert rc == 0 and "torch " in out and "GPUs:" in out and "reference" in out


@pytest.mark.slow
def test_demo_runs_two_cpu_ranks_and_checks_itself(capsys, clean_env):
    """`arnorm demo` spawns 2 gloo ranks, runs the layers and reports every layer within tolerance."""
    rc, out = run(
        capsys,
        "demo",
        "--tp",
        "2",
        "--layers",
        "2",
        "--tokens",
        "8",
        "--hidden",
        "128",
        "--quant",
        "fp8_static",
        "--device",
        "cpu",
        "--backend",
        "reference",
    )
    assert rc == 0, out
    assert "backend on every rank: reference (agreed)" in out and "-> OK" in out
    assert len(re.findall(r"^\s+[01]\s+0\s+0\s", out, re.M)) == 2
