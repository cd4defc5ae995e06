"""Rank side of the plugin attacks: fake backends that misbehave on some ranks, in every hook.

The classes are loaded in the rank processes by the loader string ``relia_plugins:<Class>``; they
misbehave on the global ranks in :data:`BAD` (set by each scenario). Each scenario registers the
misbehaving backend at priority 70 above ``fast`` (50, a correct all-reduce) and the reference, and
returns ``("ok", (chain, (status, reasons) of the misbehaving backend, next call paired))`` or
``("error", type, message)``.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch

import arnorm
from arnorm.plugin import BackendSpec

import fake_backends
from ranks_fixtures import attempt
from relia_envs import OP_ARGS, H, _paired
from relia_harness import Ctx

#: Global ranks that misbehave in the current scenario.
BAD: set[int] = set()
#: What GarbageProbe returns on a bad rank.
GARBAGE: list[Any] = [None]


def _bad() -> bool:
    import torch.distributed as dist

    return dist.get_rank() in BAD


class ExitProbe(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "exitprobe"

    @classmethod
    def probe(cls, problem):
        if _bad():
            raise SystemExit(3)
        return ()


class GarbageProbe(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "garbageprobe"

    @classmethod
    def probe(cls, problem):
        return GARBAGE[0] if _bad() else ()


class GeneratorProbe(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "genprobe"

    @classmethod
    def probe(cls, problem):  # a generator function: plausible plugin style, reasons are yielded
        if _bad():
            yield "topology: no NVLink (needs P2P access between the GPUs)"


class SlowProbe(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "slowprobe"

    @classmethod
    def probe(cls, problem):
        if _bad():
            time.sleep(2.0)
        return ()


class ExitCreate(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "exitcreate"

    @classmethod
    def create(cls, problem, comm, settings):
        if _bad():
            raise SystemExit("workspace")
        return cls(problem, comm)


class NoneCreate(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "nonecreate"

    @classmethod
    def create(cls, problem, comm, settings):
        return None if _bad() else cls(problem, comm)


class ExitCheckTokens(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "exittokens"

    def check_tokens(self, num_tokens):
        if _bad():
            raise SystemExit("budget")
        return ()


class RaisingClose(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "raisingclose"
    error: ClassVar[type[BaseException]] = RuntimeError

    def close(self):
        if _bad():
            raise type(self).error("cannot free the workspace")


class TokensAndCloseRaise(ExitCheckTokens):
    """check_tokens raises on the bad ranks, close() raises on every rank (the failed-build path)."""

    name: ClassVar[str] = "tokensclose"

    def close(self):
        raise RuntimeError("cannot free the workspace")


def _install(name: str, loader: str) -> None:
    bad = BackendSpec(name=name, priority=70, capabilities=fake_backends.CPU_ANY, loader=loader)
    fake_backends.install(bad, fake_backends.spec("fast", 50, "AllReduceBackend"))


def _ranks(ctx: Ctx, which: str) -> set[int]:
    return {ctx.last} if which == "one" else set(range(ctx.world))


def run(ctx: Ctx, cls: type, which: str, strict: bool = False, **env: str) -> tuple:
    """Misbehave on one rank or all, build in auto (or strict) mode, call once, close."""
    BAD.clear()
    BAD.update(_ranks(ctx, which))
    os.environ.update(env)
    _install(cls.name, f"{__name__}:{cls.__name__}")

    def build() -> tuple:
        backend = cls.name if strict else None
        op = arnorm.AllReduceNorm(ctx.group, **OP_ARGS, backend=backend)
        try:
            v = op.explain().verdict(cls.name)
            return op.explain().chain, (v.status, v.reasons), _paired(ctx, op)
        finally:
            op.close()

    return attempt(build)


def _garbage(ctx: Ctx, value: Any) -> tuple:
    GARBAGE[0] = value
    return run(ctx, GarbageProbe, "one")


def _import_exit(ctx: Ctx) -> tuple:
    """The backend's module raises SystemExit at import on the last rank."""
    BAD.clear()
    BAD.add(ctx.last)
    _install("badimport", "relia_badimport:Backend")

    def build() -> tuple:
        with arnorm.AllReduceNorm(ctx.group, **OP_ARGS) as op:
            v = op.explain().verdict("badimport")
            return op.explain().chain, (v.status, v.reasons), _paired(ctx, op)

    return attempt(build)


def _close(ctx: Ctx, which: str, error: type[BaseException]) -> tuple:
    """close() raises on some ranks: every rank returns from close(), the op is closed everywhere,
    the ranks stay in step. Returns (close outcome, warned here, call after close, next op paired)."""
    BAD.clear()
    BAD.update(_ranks(ctx, which))
    RaisingClose.error = error
    _install(RaisingClose.name, f"{__name__}:RaisingClose")
    op = arnorm.AllReduceNorm(ctx.group, **OP_ARGS, backend="raisingclose")
    first = _paired(ctx, op)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        closed = attempt(op.close)
    warned = any("cannot free the workspace" in str(w.message) for w in seen)
    after = attempt(lambda: op(torch.zeros(2, H), torch.zeros(2, H), torch.ones(H)))
    with arnorm.AllReduceNorm(ctx.group, **OP_ARGS, backend="fast") as again:
        second = _paired(ctx, again)
    return closed, warned, after, first and second


SCENARIOS: dict[str, Callable[[Ctx], Any]] = {
    "probe_exit_one": lambda c: run(c, ExitProbe, "one"),
    "probe_exit_all": lambda c: run(c, ExitProbe, "all"),
    "probe_exit_strict": lambda c: run(c, ExitProbe, "one", strict=True),
    "probe_none_one": lambda c: _garbage(c, None),
    "probe_str_one": lambda c: _garbage(c, "topology: no NVLink (needs P2P)"),
    "probe_ints_one": lambda c: _garbage(c, [1, 2]),
    "probe_generator_one": lambda c: run(c, GeneratorProbe, "one"),
    "probe_slow_one": lambda c: run(c, SlowProbe, "one", ARNORM_PROBE_TIMEOUT="0.3"),
    "probe_slow_all": lambda c: run(c, SlowProbe, "all", ARNORM_PROBE_TIMEOUT="0.3"),
    "import_exit_one": _import_exit,
    "create_exit_one": lambda c: run(c, ExitCreate, "one"),
    "create_exit_strict": lambda c: run(c, ExitCreate, "one", strict=True),
    "create_none_one": lambda c: run(c, NoneCreate, "one"),
    "create_none_all": lambda c: run(c, NoneCreate, "all"),
    "tokens_exit_one": lambda c: run(c, ExitCheckTokens, "one"),
    "tokens_exit_strict": lambda c: run(c, ExitCheckTokens, "one", strict=True),
    "tokens_and_close_raise": lambda c: run(c, TokensAndCloseRaise, "one"),
    "close_raises_one": lambda c: _close(c, "one", RuntimeError),
    "close_exits_all": lambda c: _close(c, "all", SystemExit),
}
