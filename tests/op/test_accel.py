"""The C helper (``arnorm/op/_accel.c``): built once, a subset of the Python call test, never a new error."""

from __future__ import annotations

import os
import sysconfig
import threading
from pathlib import Path

import call_kinds
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arnorm
import arnorm.op._accel as accel
from arnorm.op._check import check_call

import fake_backends as fb

H = 32
HAS_COMPILER = bool(accel._compiler() and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists())
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler or Python.h here")


def make(**kw) -> arnorm.AllReduceNorm:
    base = dict(
        hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=8, backend="fastpath"
    )
    base.update(kw)
    return arnorm.AllReduceNorm(arnorm.LOCAL, **base)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


@needs_compiler
def test_the_helper_builds_here_and_ops_with_a_fast_path_use_it(fastpath):
    """With a C compiler the helper loads from the cache; an op whose backend has a fast path holds it."""
    helper = accel.accelerator()
    assert helper.accept is not None, helper.reason
    assert helper.path is not None and helper.path.parent == accel.cache_dir()
    with make() as op:
        assert op._dispatch.accept is helper.accept
        x, r, w = rand(3, H), rand(3, H), rand(H)
        op(x.clone(), r, w)  # the Python call trusts the weight
        assert len(fastpath.fast_calls) == 1
        got = op._dispatch.accept(op._dispatch.accel_state, op._dispatch, x, r, w, None, None)
        assert got is not NotImplemented and len(fastpath.fast_calls) == 2  # the helper's own call


def test_a_failing_compiler_leaves_the_python_path_and_says_why(monkeypatch, tmp_path):
    """A compiler that exits non-zero: no helper, a reason in the rejection grammar, nothing cached."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    helper = accel._load()
    assert helper.accept is None
    assert (
        helper.reason.startswith("C compiler: false exit 1")
        and "(needs a working C compiler)" in helper.reason
    )
    assert list((tmp_path / "arnorm").iterdir()) == []


@needs_compiler
def test_a_cached_file_that_does_not_load_is_built_again(monkeypatch, tmp_path):
    """A corrupt helper in the cache (another machine's, a truncated copy): a new process builds it
    again and loads it."""
    import subprocess
    import sys

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = accel._load()
    assert first.accept is not None and first.path is not None
    # Replaced, not written over: this process has the first file mapped, and writing into a
    # mapped library is a bus error.
    bad = first.path.with_name("bad")
    bad.write_bytes(b"not a shared object")
    os.replace(bad, first.path)
    probe = "import arnorm.op._accel as a; h = a.accelerator(); print(h.accept is not None, h.path, h.reason)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["True", str(first.path)], done.stdout
    assert first.path.read_bytes()[:4] == b"\x7fELF"


def test_ops_without_the_helper_still_call_correctly(fastpath, monkeypatch):
    """Config(accelerate=False), check_calls, or no helper at all: the op runs the Python test only."""
    assert make(config=arnorm.Config(accelerate=False))._dispatch.accept is None
    assert make(config=arnorm.Config(check_calls=True))._dispatch.accept is None
    monkeypatch.setattr(accel, "_LOADED", [accel.Accelerator(None, None, "C compiler: none (needs one)")])
    with make() as op:
        assert op._dispatch.accept is None
        x, r, w = rand(2, H), rand(2, H), rand(H)
        op(x, r, w)
        assert len(fastpath.fast_calls) == 1


KINDS = call_kinds.KINDS


def _python_accepts(op, args, out) -> bool:
    """What the Python call would let through to the fast path (its full checks, raising or not)."""
    try:
        check_call(op._dispatch.rules, *args)
        if out is not None:
            op._dispatch.out_trust.check(out, args[0].shape[0], args)
    except arnorm.InvalidInputError:
        return False
    x, r = args[0], args[1]
    return x.is_contiguous() and r is not None and r.is_contiguous()


@needs_compiler
@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    quant=st.sampled_from([None, "fp8_static"]),
    inplace=st.booleans(),
    with_out=st.sampled_from([None, "trusted", "overlapping"]),
    grad=st.booleans(),
)
def test_the_helper_accepts_a_subset_of_what_the_python_call_accepts(kind, quant, inplace, with_out, grad):
    """For every drawn input the helper either declines (NotImplemented) or the Python checks pass too;
    a valid call with a trusted weight, scale and out is accepted and reaches the fast path."""
    fb.FastPathBackend.fast_calls, fb.FastPathBackend.decline = [], False
    fb.install(fb.spec("fastpath", 50, "FastPathBackend", caps=fb.WRITES_OUT))
    x, r, w = rand(4, H), rand(4, H), rand(H)
    s = torch.tensor([0.5]) if quant else None
    with make(quant=quant, inplace=inplace) as op, torch.set_grad_enabled(grad):
        out = None
        if with_out is not None:
            out = op.empty_output(4, s)
            op(x.clone(), r, w, s, out=out)  # weight, scale and out trusted
            if with_out == "overlapping":  # the same out, now meeting hidden_states
                x = out.normed if out.normed is not None else out.quant.data.view(torch.float32)
        else:
            op(x.clone(), r, w, s)
        args = call_kinds.variant(kind, x, r, w, s)
        before = len(fb.FastPathBackend.fast_calls)
        got = op._dispatch.accept(op._dispatch.accel_state, op._dispatch, *args, out)
        accepted = got is not NotImplemented
        assert accepted == (len(fb.FastPathBackend.fast_calls) == before + 1)
        if accepted:
            assert _python_accepts(op, args, out), kind
        if kind == "ok" and with_out != "overlapping":
            assert accepted, "a valid call with everything trusted must take the helper's path"


@needs_compiler
def test_an_error_in_the_fast_path_reaches_the_caller_once(fastpath, monkeypatch):
    """A fast path that raises: the caller sees that error, and the fast path ran once, not twice."""
    with make() as op:
        x, r, w = rand(2, H), rand(2, H), rand(H)
        op(x.clone(), r, w)
        calls = []

        def broken(*args):
            calls.append(args)
            raise RuntimeError("launch failed")

        op._dispatch.fast_table[2] = broken
        with pytest.raises(RuntimeError, match="launch failed"):
            op(x, r, w)
        assert len(calls) == 1
        assert op._dispatch.token == [None]  # the token came back


@needs_compiler
def test_a_second_thread_meeting_the_helpers_call_raises(fastpath):
    """While one thread is inside the fast path (taken by the helper), a second call raises."""
    with make() as op:
        x, r, w = rand(2, H), rand(2, H), rand(H)
        op(x.clone(), r, w)
        entered, release = threading.Event(), threading.Event()

        def slow_fast(*args):
            entered.set()
            release.wait(10)
            return "done"

        op._dispatch.fast_table[2] = slow_fast
        results = []
        worker = threading.Thread(target=lambda: results.append(op(x, r, w)))
        worker.start()
        assert entered.wait(10)
        try:
            with pytest.raises(arnorm.InvalidInputError, match="called from two threads at once"):
                op(x, r, w)
        finally:
            release.set()
            worker.join(10)
        assert results == ["done"] and op._dispatch.token == [None]


def test_the_c_helper_reads_the_state_fields_in_their_order():
    """_accel.c reads AccelState by position: its ST_* enum names the fields in the same order."""
    import re

    from arnorm.op import _accel

    source = _accel._SOURCE.read_text()
    body = re.search(r"enum \{(.*?)\};", source, re.S)
    assert body is not None
    names = [n.strip() for n in body.group(1).replace("\n", " ").split(",") if n.strip()]
    assert names[-1] == "ST_LEN"
    assert [n.removeprefix("ST_").lower() for n in names[:-1]] == list(_accel.AccelState._fields)
