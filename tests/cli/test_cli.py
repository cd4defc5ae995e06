"""The arnorm command line: backends, explain, doctor, demo; exit codes and one-line errors."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import arnorm
from arnorm.cli import _main as _cli
from arnorm.cli._main import build_parser, main
from arnorm.plugin import BackendSettings, Capabilities
from arnorm.registry._discovery import Registry, reset_registry
from arnorm.registry._explain import Explanation, Verdict
from arnorm.registry._spec import BackendSpec

HAS_CUDA = torch.cuda.is_available()
#: The reference serves every format of the table, listed sorted.
REFERENCE_FORMATS = sorted(["none", *arnorm.QUANT_FORMATS])
HAS_MODEL_DEMO = importlib.util.find_spec("arnorm.cli._demo_model") is not None
HAS_MODEL_DEPS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m arnorm ...`` in a subprocess without ARNORM_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARNORM_")}
    cmd = [sys.executable, "-m", "arnorm", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The single stderr line of a usage error (and no traceback)."""
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


# -- backends, explain, doctor ----------------------------------------------------------------------


def test_backends_lists_every_registered_backend(capsys):
    """`arnorm backends` has a row per backend with priority, version, status and formats."""
    rc, out = run(capsys, "backends")
    assert rc == 0
    for info in arnorm.backends():
        assert re.search(rf"^{re.escape(info.name)}\s+\S+\s+\S+\s+{info.status}\s", out, re.M), info.name
    assert re.search(rf"^reference\s+0\s+\S+\s+available\s+{','.join(REFERENCE_FORMATS)}\s+-$", out, re.M)


def test_explain_shows_choice_and_every_reason(capsys, clean_env):
    """`arnorm explain` names the backend it would pick and every other one's status and reasons."""
    rc, out = run(
        capsys, "explain", "--tp", "3", "--hidden", "4096", "--quant", "fp8_static", "--device", "cpu"
    )
    assert rc == 0
    assert "tp=3 hidden=4096 bfloat16 quant=fp8_static plain cpu" in out
    assert re.search(r"^reference\s+0\s+(selected|eligible)", out, re.M)
    for info in arnorm.backends():
        if info.status != "available":
            assert re.search(
                rf"^{re.escape(info.name)}\s+\S+\s+{info.status}\s+{re.escape(info.reason)}$", out, re.M
            )
    assert re.search(rf"^  reference\s+{', '.join(REFERENCE_FORMATS)}$", out, re.M)


def test_explain_strict_unservable_exits_nonzero(capsys, clean_env):
    """A strictly named backend that cannot serve makes explain exit 1 with its reason."""
    rc, out = run(
        capsys, "explain", "--tp", "2", "--quant", "nvfp4", "--backend", "example", "--device", "cpu"
    )
    if "registry: no backend named 'example'" in out:
        pytest.skip("the example plugin is not installed")
    assert rc == 1 and "quant: nvfp4 (needs fp8_per_token, fp8_static or none)" in out


def test_explain_rejects_bad_format_arguments(capsys):
    """A hidden size a format cannot take is a one-line error naming the argument, exit 2."""
    rc = main(["explain", "--quant", "mxfp8", "--hidden", "100", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("arnorm explain: error: hidden_size: 100 (needs a multiple of 32 for mxfp8)")


class FakeSettings(BackendSettings):
    """A backend setting explain must show."""

    depth: int = 3


def _fake_registry(monkeypatch) -> None:
    """reference plus one backend per status explain can meet on a single machine."""
    any_platform = Capabilities(platforms=frozenset({"cpu", "cuda", "rocm"}))
    cuda_only = Capabilities(platforms=frozenset({"cuda"}))
    loader = "arnorm._reference:ReferenceBackend"
    reg = Registry()
    reg.add(BackendSpec(name="reference", priority=0, capabilities=any_platform, loader=loader), "arnorm")
    reg.add(
        BackendSpec(
            name="gone", priority=5, capabilities=any_platform, loader=loader, requires=("no_such_mod_x",)
        )
    )
    old = BackendSpec(
        name="old",
        priority=6,
        capabilities=any_platform,
        loader=loader,
        distribution="pluggy",
        min_version="999",
    )
    reg.add(old)
    reg.add(
        BackendSpec(name="crashy", priority=7, capabilities=any_platform, loader="no_such_pkg_x.mod:Backend")
    )
    reg.add(BackendSpec(name="gpuonly", priority=8, capabilities=cuda_only, loader=loader))
    reg.add(
        BackendSpec(name="off", priority=9, capabilities=any_platform, loader=loader, settings=FakeSettings),
    )
    reset_registry(reg)
    monkeypatch.setenv("ARNORM_DISABLE", "off")
    monkeypatch.setenv("ARNORM_OFF_DEPTH", "7")


def test_explain_shows_new_statuses_with_a_legend_and_settings(capsys, clean_env):
    """Every status explain meets is in the table and explained once; backend settings are shown."""
    _fake_registry(clean_env)
    rc, out = run(capsys, "explain", "--device", "cpu", "--hidden", "64")
    assert rc == 0
    expected = {
        "off": "disabled",
        "gpuonly": "incompatible",
        "crashy": "broken",
        "old": "outdated",
        "gone": "not_installed",
        "reference": "selected",
    }
    for name, status in expected.items():
        assert re.search(rf"^{name}\s+\d+\s+{status}\s", out, re.M), (name, out)
        assert re.search(rf"^  {status}\s+{re.escape(arnorm.STATUSES[status])}$", out, re.M), (status, out)
    assert "version: pluggy " in out and "(needs >= 999" in out
    assert "import: ModuleNotFoundError" in out and "platform: cpu (needs cuda)" in out
    assert "settings of off: depth=7" in out


def test_status_legend_covers_statuses_only_ops_produce():
    """The legend explains unprobed, setup_failed and fallback, which only a built op reports."""
    from arnorm._problem import Problem

    problem = Problem(2, 64, "bfloat16", 1e-6, 0.0, None, None, 8, True, True, "cpu", "cpu")
    verdicts = (
        Verdict("a", "selected"),
        Verdict("b", "fallback"),
        Verdict("c", "setup_failed", ("setup: RuntimeError: x (needs y)",)),
        Verdict("d", "unprobed", ("not probed: a serves every token count",)),
    )
    legend = _cli.status_legend(Explanation(problem, "auto", verdicts, ("a", "b")))
    assert [line.split()[0] for line in legend] == ["selected", "fallback", "setup_failed", "unprobed"]
    assert all(arnorm.STATUSES[line.split()[0]] in line for line in legend)


def test_doctor_reports_machine_and_backends(capsys):
    """`arnorm doctor` shows python, torch, GPUs and each backend's status."""
    rc, out = run(capsys, "doctor")
    assert rc == 0 and "torch " in out and "GPUs:" in out and "reference" in out
    assert "call check:" not in out  # said only when ARNORM_CHECK_CALLS compares every call


# -- user mistakes: exit 2, one line, no traceback ---------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["explain", "demo"])
def test_cuda_device_without_cuda_is_a_one_line_error(command):
    """`--device cuda` where there is no CUDA ends with one line on stderr and exit 2."""
    proc = run_cli(command, "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    expected = "error: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)"
    assert one_line_error(proc) == f"arnorm {command}: {expected}"


@pytest.mark.parametrize("command", ["explain", "demo", "bench"])
def test_unknown_device_is_an_argument_error(command):
    """`--device tpu` is an argument error: exit 2, the error on the last line, no traceback."""
    proc = run_cli(command, "--device", "tpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"arnorm {command}: error: argument --device:") and "tpu" in last


@pytest.mark.parametrize("command", ["explain", "demo", "bench"])
@pytest.mark.parametrize(("option", "value"), [("--tp", "0"), ("--hidden", "-5"), ("--tokens", "0")])
def test_non_positive_sizes_are_argument_errors(capsys, command, option, value):
    """`--tp 0`, `--hidden -5`, `--tokens 0` are argparse errors (exit 2), not backend rejections."""
    with pytest.raises(SystemExit) as info:
        main([command, option, value])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.strip().splitlines()[-1].startswith(f"arnorm {command}: error: argument {option}:")


@pytest.mark.parametrize(("option", "value"), [("--iters", "0"), ("--warmup", "-1"), ("--tokens", "1,x")])
def test_bad_bench_counts_are_argument_errors(capsys, option, value):
    """Bench's iteration counts and token list are checked by argparse."""
    with pytest.raises(SystemExit) as info:
        main(["bench", option, value])
    assert info.value.code == 2 and f"argument {option}:" in capsys.readouterr().err


def test_demo_hidden_not_divisible_by_tp_is_a_usage_error(capsys):
    """A synthetic stack whose hidden size does not split over the ranks is refused before spawning."""
    assert main(["demo", "--tp", "3", "--hidden", "100", "--device", "cpu"]) == 2
    assert (
        capsys.readouterr().err
        == "arnorm demo: error: --hidden 100: not a multiple of --tp 3 (needs H = k * TP)\n"
    )


def test_demo_unknown_backend_is_a_usage_error(capsys, clean_env):
    """A --backend name no plugin registered is refused before any rank is spawned."""
    assert main(["demo", "--backend", "nosuch", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("arnorm demo: error: --backend: 'nosuch' not a registered backend (needs ")
        and err.count("\n") == 1
    )
    assert main(["demo", "--backend", "reference,nosuch", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("arnorm demo: error: --backend: 'nosuch' not a registered")


def _closed_pipe(*argv: str) -> subprocess.CompletedProcess:
    """Run the CLI with a stdout pipe whose reader has already gone, as `| head -0` would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARNORM_")}
    read, write = os.pipe()
    os.close(read)  # before the child writes anything: its first write fails with EPIPE
    try:
        return subprocess.run(
            [sys.executable, "-m", "arnorm", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("argv", [("backends",), ("explain", "--device", "cpu"), ("--help",)])
def test_closed_pipe_prints_no_broken_pipe_error(argv):
    """Piping to a reader that stops (`| head`) ends quietly: no BrokenPipeError, no traceback."""
    proc = _closed_pipe(*argv)
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # 141 (128 + SIGPIPE) where arnorm saw the closed pipe; argparse's --help swallows it itself.
    assert proc.stderr == "" and proc.returncode == (0 if argv == ("--help",) else 141)


# -- help text ---------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_text():
    """Every option of every command says what it does."""
    parser = build_parser()
    missing = [
        f"{name} {'/'.join(a.option_strings)}"
        for name, sub in _subparsers(parser).items()
        for a in sub._actions
        if a.option_strings and not (a.help and a.help.strip() and a.help != argparse.SUPPRESS)
    ]
    assert not missing, missing
    assert all(p.description for p in _subparsers(parser).values())


def test_help_shows_no_restructuredtext_markup():
    """`arnorm --help` and each command's help are plain text (no ``literals`` or :roles:)."""
    parser = build_parser()
    texts = [parser.format_help(), *(p.format_help() for p in _subparsers(parser).values())]
    for text in texts:
        assert not re.search(r"``|:(func|class|meth|data|mod|attr|exc):`|\.\. \w+::", text), text


# -- demo ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not (HAS_MODEL_DEMO and HAS_MODEL_DEPS),
    reason="needs arnorm.cli._demo_model and pip install 'arnorm[transformers]'",
)
def test_demo_model_calls_the_model_demo_with_the_options(monkeypatch):
    """`arnorm demo --model gemma3` passes model, TP, device, dtype, backend and max_tokens through."""
    import arnorm.cli._demo_model as demo_model

    calls = []

    def fake(model, tp, device, **kw):
        calls.append((model, tp, device, kw))
        return 0

    inspect.signature(demo_model.run_model_demo).bind(
        "gemma3", 2, "cpu", dtype="float32", backend=None, max_tokens=4
    )
    monkeypatch.setattr(demo_model, "run_model_demo", fake)
    argv = [
        "demo",
        "--model",
        "gemma3",
        "--tp",
        "2",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-tokens",
        "4",
    ]
    assert main(argv) == 0
    assert calls == [("gemma3", 2, "cpu", {"dtype": "float32", "backend": None, "max_tokens": 4})]


@pytest.mark.skipif(
    not (HAS_MODEL_DEMO and HAS_MODEL_DEPS),
    reason="needs arnorm.cli._demo_model and pip install 'arnorm[transformers]'",
)
def test_demo_model_refuses_ranks_sharing_a_gpu(monkeypatch, capsys):
    """--model --device cuda with fewer GPUs than --tp ends with one line naming the fix (the
    unfused Hugging Face TP model crashed with two ranks on one H200), before spawning anything."""
    import arnorm.cli._demo as demo
    import arnorm.cli._main as cli

    monkeypatch.setattr(demo, "pick_device", lambda device, tp: "cuda")
    monkeypatch.setattr(cli, "_gpu_count", lambda: 1)
    assert main(["demo", "--model", "llama", "--tp", "2", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "arnorm demo: error: --device cuda: 1 GPU(s) visible for --tp 2 (needs one GPU per rank with "
        "--model: transformers' tensor parallelism does not run ranks that share a GPU); use --tp 1 "
        "or --device cpu\n"
    )


def test_demo_model_without_the_module_is_a_usage_error(monkeypatch, capsys):
    """Where arnorm.cli._demo_model is missing, --model ends with one line and exit 2."""
    monkeypatch.setitem(sys.modules, "arnorm.cli._demo_model", None)  # import raises ModuleNotFoundError
    assert main(["demo", "--model", "llama", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "arnorm demo: error: --model: this install has no model demo (arnorm.cli._demo_model is missing)\n"
    )


@pytest.mark.parametrize("extra", [("--layers", "2"), ("--quant", "none")])
def test_demo_model_refuses_synthetic_stack_options(capsys, extra):
    """Options of the synthetic stack are refused with --model, naming them."""
    assert main(["demo", "--model", "llama", *extra]) == 2
    assert (
        capsys.readouterr().err
        == f"arnorm demo: error: {extra[0]}: not used with --model (the model fixes them)\n"
    )


def test_max_tokens_without_model_is_a_usage_error(capsys):
    """--max-tokens belongs to --model; alone it is refused."""
    assert main(["demo", "--max-tokens", "4"]) == 2
    assert capsys.readouterr().err == "arnorm demo: error: --max-tokens: used with --model only\n"


@pytest.mark.slow
def test_demo_runs_two_cpu_ranks_and_checks_itself(capsys, clean_env):
    """`arnorm demo` spawns 2 gloo ranks, runs the layers and reports every layer within tolerance."""
    argv = ["demo", "--tp", "2", "--layers", "2", "--tokens", "8", "--hidden", "128", "--quant", "fp8_static"]
    rc, out = run(capsys, *argv, "--device", "cpu", "--backend", "reference")
    assert rc == 0, out
    assert "backend on every rank: reference (agreed)" in out and "-> OK" in out
    assert len(re.findall(r"^\s+[01]\s+0\s+0\s", out, re.M)) == 2


@pytest.mark.parametrize(
    ("variable", "argv"),
    [
        ("ARNORM_PROBE_TIMEOUT", ["explain", "--device", "cpu"]),
        ("ARNORM_CHECK_CALLS", ["demo", "--tp", "2", "--device", "cpu"]),
        ("ARNORM_EXAMPLE_COMPILE", ["demo", "--tp", "2", "--device", "cpu"]),
        (
            "ARNORM_EXAMPLE_COMPILE",
            ["bench", "--tp", "2", "--hidden", "64", "--tokens", "1", "--device", "cpu"],
        ),
        ("ARNORM_CHECK_CALLS", ["doctor"]),
    ],
)
def test_malformed_setting_is_a_one_line_error(capsys, clean_env, variable, argv):
    """A malformed ARNORM_* value (the core's or a backend's) ends every command before any work with
    one line naming the variable, exit 2: no rank is spawned, no traceback."""
    clean_env.setenv(variable, "abc")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"arnorm {argv[0]}: error: {variable}: 'abc' (") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "option"),
    [(["explain", "--backend", ""], "--backend"), (["explain", "--backend", ","], "--backend"),
     (["bench", "--tp", "2", "--hidden", "64", "--backends", ","], "--backends")],
)  # fmt: skip
def test_a_backend_list_naming_nothing_is_a_usage_error(capsys, clean_env, argv, option):
    """An empty --backend / --backends is a one-line usage error that says how to get auto mode."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"arnorm {argv[0]}: error: {option}: {argv[-1]!r} names no backend (needs a name")
    assert "leave it out" in err and err.count("\n") == 1


def test_bench_output_path_is_checked_before_the_run(capsys, tmp_path):
    """--json / --plot into a missing directory is a usage error before anything is timed."""
    bad = str(tmp_path / "missing" / "x.json")
    assert main(["bench", "--tp", "2", "--hidden", "64", "--tokens", "1", "--json", bad]) == 2
    assert capsys.readouterr().err == (
        f"arnorm bench: error: --json: {bad!r} (needs a file in an existing, writable directory)\n"
    )


def test_demo_misspelt_backend_says_did_you_mean(capsys, clean_env):
    assert main(["demo", "--backend", "refrence", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("arnorm demo: error: --backend: 'refrence' not a registered backend (needs ")
    assert err.endswith("; did you mean 'reference'?)\n"), err


def test_explain_misspelt_backend_says_did_you_mean(capsys, clean_env):
    code, out = run(capsys, "explain", "--device", "cpu", "--backend", "refrence")
    assert code == 1 and "no backend named 'refrence'" in out and "did you mean 'reference'?)" in out


def test_explain_with_a_named_backend_prints_only_its_settings(capsys, clean_env):
    """--backend triton: triton's settings, not every installed backend's (auto mode shows all)."""
    _, auto = run(capsys, "explain", "--device", "cpu", "--hidden", "64")
    assert "settings of triton:" in auto and "settings of triton_symm:" in auto
    _, named = run(capsys, "explain", "--device", "cpu", "--hidden", "64", "--backend", "triton")
    shown = [line.split(":")[0] for line in named.splitlines() if line.startswith("settings of ")]
    assert shown == ["settings of triton"], named


def test_explain_warns_about_a_misspelt_disabled_name(capsys, clean_env):
    """ARNORM_DISABLE naming no registered backend is said by explain, as building an op says it."""
    clean_env.setenv("ARNORM_DISABLE", "tritn")
    with pytest.warns(arnorm.ArnormWarning, match=r"'tritn' is not a registered backend \(needs one of "):
        assert main(["explain", "--device", "cpu"]) == 0


def test_doctor_says_when_every_call_is_compared_across_ranks(capsys, clean_env):
    """doctor's call-check line follows ARNORM_CHECK_CALLS."""
    clean_env.setenv("ARNORM_CHECK_CALLS", "1")
    rc, out = run(capsys, "doctor")
    assert rc == 0 and "call check: every call compared across ranks first" in out


@pytest.mark.slow
def test_demo_with_a_backend_that_cannot_serve_prints_its_reasons_once(capsys, clean_env):
    """A strict backend the ranks reject ends the demo with exit 1 and the explanation, no traceback."""
    argv = [
        "demo",
        "--backend",
        "flashinfer",
        "--device",
        "cpu",
        "--tokens",
        "4",
        "--layers",
        "1",
        "--hidden",
        "64",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert re.match(r"arnorm demo: (BackendNotInstalledError|NoEligibleBackendError): ", err), err
    assert re.search(r"^flashinfer\s+300\s+(not_installed|incompatible)\s", err, re.M), err


def test_demo_model_missing_dependency_is_a_usage_error(monkeypatch, capsys):
    """A model demo whose own dependency is missing ends with one line naming it, exit 2."""
    import types

    def importer_failing_on_a_dependency():
        raise ModuleNotFoundError("No module named 'transformers_x'", name="transformers_x")

    module = types.ModuleType("arnorm.cli._demo_model")
    module.__getattr__ = lambda name: importer_failing_on_a_dependency()  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "arnorm.cli._demo_model", module)
    assert main(["demo", "--model", "gemma3", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "arnorm demo: error: --model: the model demo needs transformers_x, which is not installed\n"
    )
