"""The C helper that runs the op's valid-call test (``arnorm/op/_accel.c``): built once, cached, optional.

An eager engine pays the host cost of every call, every layer, every step; about half of the
Python test's cost was the interpreter's own work between its calls into torch. The C source
makes the same test (a subset: it declines whatever it is not sure of, and the Python call then
runs as before), so the helper is a speed-up only: when it cannot be built or loaded, or the op's
``Config(accelerate=False)`` (``ARNORM_ACCELERATE=0``) turns it off, every call takes the Python
path, with the same results and errors.

It is compiled with ``$CC`` or the C compiler Python itself was built with (``sysconfig``'s
``CC``; else ``cc``, ``gcc`` or ``clang``: Triton builds its launchers the same way), against
this interpreter's headers, into
``$XDG_CACHE_HOME/arnorm`` (default ``~/.cache/arnorm``) under a name
holding the source's hash and the interpreter's ABI; later processes load it in about a
millisecond. :func:`accelerator` says why it is absent (``arnorm doctor`` prints it).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["AccelState", "Accelerator", "accelerator", "cache_dir"]

_SOURCE = Path(__file__).with_name("_accel.c")
_MODULE = "_arnorm_accel"
#: Seconds the compiler may take (a cold compile takes well under one).
_BUILD_TIMEOUT = 60


class AccelState(NamedTuple):
    """The op's constants as the C helper reads them, by position: the order of these fields is
    the order of ``_accel.c``'s ``ST_*`` enum (a test holds the two equal). The first six are also
    the Python test's constants."""

    hidden: int
    row_bytes: int
    dtype: Any
    on_cpu: bool
    device_index: int
    max_tokens: int
    scaled: bool
    add_residual: bool
    #: The call's token (one call at a time per op).
    token: list[None]
    fast_table: list[Any]
    #: Trusted weights and scales: ``id(tensor) -> data pointer``.
    weights: dict[int, int]
    scales: dict[int, int]
    #: Trusted ``out=`` objects: ``id(out) -> (T, ((tensor, start, end), ...))``.
    out_spans: dict[int, Any]
    grad_enabled: Callable[[], bool]


class Accelerator:
    """The loaded helper's ``accept`` function, or ``None`` with the reason (``"<aspect>: <found>
    (needs <required>)"``)."""

    __slots__ = ("accept", "path", "reason")

    def __init__(self, accept: Callable[..., Any] | None, path: Path | None, reason: str) -> None:
        self.accept = accept
        self.path = path
        self.reason = reason

    def __repr__(self) -> str:
        return f"Accelerator({'loaded from ' + str(self.path) if self.accept else self.reason})"


_LOADED: list[Accelerator] = []


def cache_dir() -> Path:
    """Where the built helper is kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "arnorm"


def accelerator() -> Accelerator:
    """The helper for this process (built or loaded on the first call, then remembered)."""
    if not _LOADED:
        _LOADED.append(_load())
    return _LOADED[0]


def _load() -> Accelerator:
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return Accelerator(None, None, f"python: {sys.implementation.name} (needs CPython with its GIL)")
    try:
        source = _SOURCE.read_bytes()
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        # A home directory shared by machines of other platforms or interpreters gets one file each.
        key = source + suffix.encode() + sys.version.encode() + sysconfig.get_platform().encode()
        path = cache_dir() / f"{_MODULE}-{hashlib.sha256(key).hexdigest()[:16]}{suffix}"
        cached = path.exists()
        if not cached:
            reason = _build(path)
            if reason:
                return Accelerator(None, None, reason)
        try:
            return Accelerator(_import(path).accept, path, "")
        except ImportError:
            if not cached:
                raise
        # A cached file this interpreter cannot load (another libc behind the same platform tag,
        # a truncated copy): built again once, here.
        reason = _build(path)
        return Accelerator(None, None, reason) if reason else Accelerator(_import(path).accept, path, "")
    except Exception as exc:  # a speed-up must never break the op: report and go without
        return Accelerator(None, None, f"C helper: {type(exc).__name__}: {exc} (needs a working build)")


def _build(path: Path) -> str:
    """Compile into ``path`` (atomically: ranks building at once each write their own file)."""
    include = sysconfig.get_paths().get("include", "")
    if not (Path(include) / "Python.h").exists():
        return f"Python.h: not in {include!r} (needs the interpreter's headers, e.g. python3-dev)"
    cc = _compiler()
    if cc is None:
        return "C compiler: none found ($CC, sysconfig's CC, cc, gcc, clang) (needs a C compiler)"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    cmd = [*cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(_SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        Path(tmp).unlink(missing_ok=True)
        return f"C compiler: {cc[0]} failed to run ({type(exc).__name__}) (needs a C compiler)"
    if done.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"C compiler: {cc[0]} exit {done.returncode}, {tail[0]} (needs a working C compiler)"
    os.replace(tmp, path)
    return ""


def _compiler() -> list[str] | None:
    """``$CC``, else the compiler Python was built with, else ``cc``/``gcc``/``clang``: the first found."""
    import shutil

    for choice in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        words = shlex.split(choice or "")
        if words and shutil.which(words[0]):
            return words
    return None


def _import(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no loader for {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
