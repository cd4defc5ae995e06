"""Faults at the plugin / op boundary (issue 37): a plugin whose import never returns, a backend that
breaks its ``caller_outputs`` promise, tensors with the negative or conjugate bit, a compiled layer in
grad mode, and limits told up front.

Every test is bounded in time: the hanging imports run in a subprocess with a timeout (a hang fails
the test instead of blocking the run), the rest on small shapes in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import arnorm

TESTS = Path(__file__).resolve().parents[1]
H = 64
#: Where the in-process calls run: the GPU where there is one (triton compiles for it), else the
#: CPU (triton under its interpreter).
DEVICE = (
    torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
)

#: A module whose import never returns (a plugin waiting on a lock, a device, a network mount).
HANGING_MODULE = "import time\n\ntime.sleep(3600)\n"


def _run(tmp_path: Path, code: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Run ``code`` with ``tmp_path`` and tests/ on the path; ``(the RESULT json it printed, its
    whole output)``. A hang past 120 s, in the code or at interpreter exit, fails."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ARNORM_")}
    environ.update(env or {})
    paths = (str(tmp_path), str(TESTS), environ.get("PYTHONPATH", ""))
    environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = [sys.executable, "-c", code]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {time.monotonic() - start:.0f} s: {exc.stdout!r} {exc.stderr!r}")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return (json.loads(lines[-1][7:]) if lines else {}), text


BUILD_WITH_HANGING_MODULE = textwrap.dedent("""
    import json, threading, time
    import torch, arnorm, fake_backends
    from arnorm.registry._probe import clear_probe_cache
    from arnorm.plugin import BackendSpec

    fake_backends.install(BackendSpec(
        name="hangs", priority=70, capabilities=fake_backends.CPU_ANY, loader="faults_hangs:Backend"))
    args = dict(hidden_size=8, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6),
                config=arnorm.Config(probe_timeout=2))
    out = {}
    start = time.monotonic()
    try:
        arnorm.AllReduceNorm(arnorm.LOCAL, backend="hangs", **args)
        out["strict"] = "built"
    except arnorm.ArnormError as exc:
        out["strict"] = f"{type(exc).__name__}: {exc}"
    out["strict_s"] = time.monotonic() - start
    clear_probe_cache()  # the next build probes again: it must not start (and wait on) a second import
    with arnorm.AllReduceNorm(arnorm.LOCAL, **args) as op:
        v = op.explain().verdict("hangs")
        out["auto"] = [op.backend, v.status, list(v.reasons)]
    out["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("arnorm"))
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_backend_module_whose_import_never_returns_is_rejected_in_the_probe_timeout(tmp_path):
    """backend="hangs" with probe_timeout=2: construction raises BackendBrokenError in about 2 s
    ("import: no answer in 2 s"); auto mode then picks the reference and lists the plugin as broken,
    without a second wait or a second thread; the process exits although the import never returns."""
    (tmp_path / "faults_hangs.py").write_text(HANGING_MODULE)
    out, text = _run(tmp_path, BUILD_WITH_HANGING_MODULE)
    assert out["strict"].startswith("BackendBrokenError: backend 'hangs'"), text
    assert "import: no answer in 2 s" in out["strict"], text
    assert out["strict_s"] < 30, out
    backend, status, reasons = out["auto"]
    assert (backend, status) == ("reference", "broken"), out
    assert "import: no answer in 2 s" in reasons[0] and "still running" in reasons[0], out
    assert out["threads"] == ["arnorm-import"], out


def _hanging_entry_point(tmp_path: Path) -> None:
    info = tmp_path / "faults_hanging_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faults-hanging-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[arnorm.backends]\nhanging = faults_hanging_ep\n")
    (tmp_path / "faults_hanging_ep.py").write_text(HANGING_MODULE)


USE_WITH_HANGING_ENTRY_POINT = textwrap.dedent("""
    import contextlib, io, json, time, warnings
    import torch, arnorm
    from arnorm.cli._main import main
    warnings.simplefilter("ignore")
    start = time.monotonic()
    infos = {i.name: [i.status, i.reason] for i in arnorm.backends()}
    out = {"hanging": infos.get("hanging"), "discovery_s": time.monotonic() - start}
    with arnorm.AllReduceNorm(arnorm.LOCAL, hidden_size=8, dtype=torch.float32,
                              norm=arnorm.RMSNorm(1e-6), backend="reference") as op:
        out["built"] = op.backend
    for command in (["backends"], ["explain", "--tp", "1", "--hidden", "256"]):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            status = main(command)
        out[command[0]] = [status, text.getvalue()]
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_entry_point_whose_import_never_returns_is_listed_as_timed_out(tmp_path):
    """An installed entry point whose module import never returns: arnorm.backends(), construction
    with backend="reference", and the CLI's `backends` and `explain` finish, listing the plugin as
    broken with "import: no answer in 2 s" (ARNORM_PROBE_TIMEOUT=2); the process exits."""
    _hanging_entry_point(tmp_path)
    out, _ = _run(tmp_path, USE_WITH_HANGING_ENTRY_POINT, env={"ARNORM_PROBE_TIMEOUT": "2"})
    status, reason = out["hanging"]
    assert status == "broken" and "import: no answer in 2 s, still running" in reason, out
    assert out["built"] == "reference" and out["discovery_s"] < 30, out
    for command in ("backends", "explain"):
        code, printed = out[command]
        assert code == 0 and "hanging" in printed and "no answer in 2 s" in printed, out
    assert "reference" in out["explain"][1], out


# -- caller_outputs: the caller's tensors come back ------------------------------------------------


@pytest.mark.parametrize("cls", ["IgnoresOut", "FastIgnoresOut"])
def test_backend_declaring_caller_outputs_that_ignores_out_raises_naming_it(clean_env, cls):
    """A backend declaring caller_outputs=True whose call (or fast path) returns new tensors instead
    of writing out=: the call raises naming the backend and the output, not a silent stale buffer."""
    import faults_backends

    import fake_backends

    backend = getattr(faults_backends, cls)
    fake_backends.install(faults_backends.spec(backend))
    with arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=H,
        dtype=torch.bfloat16,
        norm=arnorm.RMSNorm(1e-6),
        backend=backend.name,
        device="cpu",
    ) as op:
        x, r, w = torch.randn(3, H).bfloat16(), torch.randn(3, H).bfloat16(), torch.randn(H).bfloat16()
        assert op(x.clone(), r, w).normed is not None  # no out=: nothing to compare
        out = op.empty_output(3)
        with pytest.raises(arnorm.ArnormError, match=rf"backend {backend.name!r}.*out\.normed"):
            op(x.clone(), r, w, out=out)


def test_conformance_suite_calls_with_out_and_fails_a_backend_that_ignores_it(clean_env):
    """The suite's cases include an out= call, and a backend ignoring out fails it."""
    import faults_backends

    from arnorm.testing import ConformanceSuite
    from arnorm.testing._cases import run_case

    import fake_backends

    fake_backends.install(faults_backends.spec(faults_backends.IgnoresOut))

    class Suite(ConformanceSuite):
        backend = "ignores_out"

    with_out = [c for c in Suite.cases() if "-out" in c.id]
    assert len(with_out) == 1, [c.id for c in Suite.cases()]
    result = run_case("ignores_out", with_out[0], 0, 1, torch.device("cpu"))
    assert result.outcome == "error" and "out.normed" in result.error, result


# -- negative and conjugate bits -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("arg", ["hidden_states", "residual", "weight", "out.normed"])
def test_tensor_with_the_negative_bit_is_rejected_before_any_backend(clean_env, backend, arg):
    """op(x, torch._neg_view(r), w): a pointer-based backend would read the memory without the
    negation. Every backend rejects it the same way, naming the argument and the fix."""
    kw = dict(hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), device=DEVICE)
    with arnorm.AllReduceNorm(arnorm.LOCAL, backend=backend, **kw) as op:
        g = torch.Generator().manual_seed(0)
        x, r = torch.randn(2, H, generator=g).bfloat16(), torch.randn(2, H, generator=g).bfloat16()
        w = torch.randn(H, generator=g).bfloat16()
        x, r, w = x.to(DEVICE), r.to(DEVICE), w.to(DEVICE)
        args = {"hidden_states": x.clone(), "residual": r, "weight": w}
        out = op.empty_output(2)
        if arg == "out.normed":
            out = out._replace(normed=torch._neg_view(out.normed))
        else:
            args[arg] = torch._neg_view(args[arg])
        with pytest.raises(arnorm.InvalidInputError, match=rf"^{arg}: negative bit set"):
            op(**args, out=out if arg == "out.normed" else None)
        # The same tensors resolved give the reference's result.
        resolved = {k: v.resolve_neg() for k, v in args.items()}
        with arnorm.AllReduceNorm(arnorm.LOCAL, backend="reference", **kw) as ref:
            want = ref(**{**resolved, "hidden_states": resolved["hidden_states"].clone()})
        got = op(**{**resolved, "hidden_states": resolved["hidden_states"].clone()})
        # Residual bitwise; normed within the contract's ulp (a GPU kernel may round once apart). A
        # negation read as memory flips signs: far outside either.
        assert torch.equal(got.residual, want.residual)
        torch.testing.assert_close(got.normed, want.normed, rtol=2**-7, atol=1e-6)


def test_negative_bit_of_a_conjugate_imaginary_part_is_rejected(clean_env):
    """``z.conj().imag`` is a public way to get a real tensor with the negative bit."""
    z = torch.randn(2, H, dtype=torch.complex64)
    with arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=H,
        dtype=torch.float32,
        norm=arnorm.RMSNorm(1e-6),
        backend="reference",
        device="cpu",
    ) as op:
        r = z.conj().imag
        assert r.is_neg()
        with pytest.raises(arnorm.InvalidInputError, match=r"^residual: negative bit set"):
            op(torch.randn(2, H), r, torch.ones(H))


# -- torch.compile in grad mode --------------------------------------------------------------------


def _compiled_layer_in_grad_mode(device: torch.device, compile_backend: str) -> None:
    class Layer(torch.nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op
            self.weight = torch.nn.Parameter(torch.randn(H, dtype=torch.bfloat16, device=device))

        def forward(self, x, r):
            o = self.op(x, r, self.weight)
            return o.normed, o.residual

    with arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), device=device
    ) as op:
        layer = Layer(op)
        x = torch.randn(4, H, dtype=torch.bfloat16, device=device)
        r = torch.randn(4, H, dtype=torch.bfloat16, device=device)
        assert torch.is_grad_enabled() and layer.weight.requires_grad
        want_x = x.clone()
        want = layer(want_x, r)
        got_x = x.clone()
        got = torch.compile(layer, fullgraph=True, backend=compile_backend)(got_x, r)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got_x, want_x)  # in place: the new residual is in hidden_states
        with pytest.raises(arnorm.InferenceOnlyError):
            got[0].float().sum().backward()


def test_compiled_layer_with_a_grad_requiring_parameter_runs_in_grad_mode(clean_env):
    """torch.compile(fullgraph=True), grad mode, weight an nn.Parameter, default in-place op: the
    forward equals eager and a backward raises InferenceOnlyError (aot_eager: AOT autograd, where
    the in-place failure was, without a C++ build)."""
    _compiled_layer_in_grad_mode(torch.device("cpu"), "aot_eager")


@pytest.mark.gpu
def test_compiled_layer_with_a_grad_requiring_parameter_runs_in_grad_mode_on_gpu(clean_env):
    """The same with inductor on the GPU (the backend auto mode picks there)."""
    _compiled_layer_in_grad_mode(torch.device("cuda", torch.cuda.current_device()), "inductor")


# -- limits told up front --------------------------------------------------------------------------


def test_probe_timeout_beyond_what_a_wait_can_take_is_a_config_error(clean_env):
    """A probe_timeout a thread join cannot take (1e10 s) is a ConfigError in arnorm's grammar,
    from code and from ARNORM_PROBE_TIMEOUT, not an OverflowError from inside selection."""
    with pytest.raises(arnorm.ConfigError, match=r"^Config.probe_timeout: 1.*\(needs .*<= 86400"):
        arnorm.Config(probe_timeout=1e10)
    clean_env.setenv("ARNORM_PROBE_TIMEOUT", "1e10")
    with pytest.raises(arnorm.ConfigError, match=r"ARNORM_PROBE_TIMEOUT: .1e10. \(needs .*<= 86400"):
        arnorm.Config()


def test_max_tokens_beyond_what_arnorm_can_table_is_rejected_up_front(clean_env):
    """max_tokens=2**31 raises InvalidInputError naming max_tokens and the limit at once, not a bare
    MemoryError after seconds of work."""
    start = time.monotonic()
    with pytest.raises(arnorm.InvalidInputError, match=r"^max_tokens: 2147483648 \(needs an int from 1 to "):
        arnorm.AllReduceNorm(
            arnorm.LOCAL, hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6), max_tokens=2**31
        )
    assert time.monotonic() - start < 5


@pytest.mark.slow
def test_backend_module_hanging_on_one_rank_is_rejected_on_every_rank():
    """On 2 gloo ranks, the backend's module import never returns on rank 1: both ranks reject it
    with rank 1's reason, pick the same next backend, compute the right sum, and exit."""
    import faults_backends

    from arnorm.testing import run_ranks

    per_rank = run_ranks(2, faults_backends.build_with_import_hanging_on_rank_one, timeout=90)
    for backend, status, reasons, value in per_rank:
        assert (backend, status, value) == ("reference", "broken", 3.0), per_rank
        assert any(r.startswith("rank 1: import: no answer in 2 s") for r in reasons), per_rank
