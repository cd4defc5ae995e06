"""``run_ranks``: run a function on N fresh processes joined in one torch.distributed group.

The processes come from a fork server that has imported torch once (``multiprocessing``'s
``forkserver`` start method with torch preloaded; ``spawn`` where there is none): a rank starts in
a tenth of a second instead of paying torch's import, and it is still a fresh process, never a fork
of the caller with its threads, CUDA context or state. Each rank runs with the caller's
environment and ``sys.path`` as they are at the call (as a spawned process would), then ``env``.

The parent owns a ``TCPStore`` on port 0 (no free-port race); each child connects, initializes
the default group (gloo on CPU, NCCL when asked and GPUs exist), runs the function and sends its
return value or its traceback back through a queue.

A rank that fails ends the run within seconds, not at the timeout: the parent watches both the
queue and the processes. The function and its arguments travel pickled and are unpickled inside
the child's error handling, so a module that fails to import on a rank reports its traceback like
any other error; a rank that dies without a word (a segfault, ``os._exit``) is reported with its
exit code and what ``faulthandler`` wrote.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["RankError", "run_ranks"]

#: How long the other ranks may still report once one rank has failed (their own errors often
#: explain the first one), before they are stopped.
FAILURE_GRACE_S = 3.0
#: How often the parent looks at the processes while it waits for results.
POLL_S = 0.2


class RankError(RuntimeError):
    """A rank raised or died; the message holds every failing rank's traceback or exit code.
    ``timed_out``: no rank failed, but some had not finished when the timeout passed."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


#: Modules the fork server imports once, so no rank pays for them: only torch's, never arnorm's
#: (arnorm is imported in the rank after its environment is set, as in a spawned process).
PRELOAD = ("torch", "torch.distributed")

_context: Any = None


def _rank_context() -> Any:
    """The ``multiprocessing`` context ranks start from: one fork server per calling process,
    torch preloaded, started on first use; ``spawn`` where the platform has no fork server."""
    global _context
    if _context is None:
        import multiprocessing as mp

        if "forkserver" in mp.get_all_start_methods():
            server = mp.get_context("forkserver")
            server.set_forkserver_preload(list(PRELOAD))
            _context = server
        else:
            _context = mp.get_context("spawn")
    return _context


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    payload: bytes,
    env: Mapping[str, str],
    timeout: float,
    crash_log: str,
    queue: Any,
    caller_env: Mapping[str, str],
    caller_path: Sequence[str],
) -> None:
    # The fork server's environment and path are those of its start: the caller's, now, replace them.
    os.environ.clear()
    os.environ.update(caller_env)
    os.environ.update(env)
    sys.path[:] = list(caller_path)
    with open(crash_log, "w") as log:
        import faulthandler

        faulthandler.enable(log)  # a segfault or abort leaves a Python traceback for the parent
        dist: Any = None
        try:
            from datetime import timedelta

            # Inside the try: importing fn's module may fail on this rank only.
            fn, args = pickle.loads(payload)
            import torch
            import torch.distributed as dist

            if torch.cuda.is_available():
                torch.cuda.set_device(rank % torch.cuda.device_count())
            wait = timedelta(seconds=timeout)
            store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=wait)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=wait)
            message: tuple[int, bool, bytes | str] = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:
            message = (rank, False, traceback.format_exc())
        # Report before tearing down: the parent stops peers stuck in a collective with a dead rank.
        queue.put(message)
        if dist is not None and dist.is_initialized():
            with contextlib.suppress(Exception):  # the result is sent; teardown errors change nothing
                dist.destroy_process_group()
    # A rank started by the fork server ends in os._exit, which skips the exit handlers a spawned
    # process runs (arnorm's closes the ops left open): run them here, as an interpreter exit would.
    atexit._run_exitfuncs()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "was still running and was stopped"
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} without sending a result"
    return f"exited with code {code} without sending a result"


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    env: Sequence[Mapping[str, str]] | Mapping[str, str] | None = None,
    timeout: float = 180.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results in rank order.

    ``fn`` must be importable by name (a module-level function); its return value must pickle.
    ``env`` sets environment variables in the children, the same for all or one mapping per rank.
    ``timeout`` (seconds) bounds the whole run, and also the children's rendezvous and collectives.

    Raises :class:`RankError` with every failing rank's traceback as soon as one rank fails (its
    peers get :data:`FAILURE_GRACE_S` seconds to report, then are stopped), when a rank dies
    without a result, or when the timeout passes.
    """
    import torch.distributed as dist

    per_rank = list(env) if isinstance(env, Sequence) else [env or {}] * world_size
    if len(per_rank) != world_size:
        raise ValueError(f"env: {len(per_rank)} mappings (needs one per rank, {world_size})")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"fn, args: do not pickle ({exc}) (needs a module-level function and picklable args)"
        ) from exc
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    ctx = _rank_context()
    results: Any = ctx.Queue()
    caller_env, caller_path = dict(os.environ), list(sys.path)
    logs = tempfile.TemporaryDirectory(prefix="arnorm-ranks-")
    crash_logs = [os.path.join(logs.name, f"rank{r}.log") for r in range(world_size)]
    procs = [
        ctx.Process(
            target=_child,
            args=(
                r,
                world_size,
                store.port,
                backend,
                payload,
                per_rank[r],
                timeout,
                crash_logs[r],
                results,
                caller_env,
                caller_path,
            ),
            name=f"arnorm-rank-{r}",
        )
        for r in range(world_size)
    ]
    got: dict[int, tuple[bool, Any]] = {}
    dead: dict[int, int | None] = {}
    error, clean, timed_out = "", False, False
    try:
        for p in procs:
            p.start()
        order: list[int] = []
        error, timed_out = _collect(procs, results, got, dead, timeout, order)
        if error:
            error += _failures(order or sorted(dead), got, dead, crash_logs)
        clean = not error
    finally:
        for p in procs:
            if p.is_alive() and not clean:
                p.kill()  # a failed run: its peers may be stuck in a collective with the dead rank
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
        logs.cleanup()
    if error:
        raise RankError(error, timed_out=timed_out)
    return [pickle.loads(got[r][1]) for r in range(world_size)]


def _collect(
    procs: list[Any],
    results: Any,
    got: dict[int, tuple[bool, Any]],
    dead: dict[int, int | None],
    timeout: float,
    order: list[int],
) -> tuple[str, bool]:
    """Wait for every rank's message; ``("", False)`` when all succeeded, else the headline of the
    failure and whether it is the timeout with no rank failed (``dead`` then also holds the ranks
    still running, as ``None``; ``order`` the ranks to report, the likely cause first)."""
    import queue as queue_mod

    world_size = len(procs)
    deadline = time.monotonic() + timeout
    failed: list[int] = []  # in the order the failures were noticed: the first is usually the cause
    give_up = float("inf")  # once a rank failed: the end of the others' grace period

    def receive(wait: float) -> bool:
        try:
            rank, ok, value = results.get(timeout=wait)
        except queue_mod.Empty:
            return False
        got[rank] = (ok, value)
        if not ok:
            failed.append(rank)
        return True

    while len(got) + len(dead) < world_size:
        now = time.monotonic()
        if now >= min(give_up, deadline):
            break
        if receive(POLL_S):
            if failed:
                give_up = min(give_up, time.monotonic() + FAILURE_GRACE_S)
            continue
        for r, p in enumerate(procs):
            if r in got or r in dead or p.exitcode is None:
                continue
            end = time.monotonic() + 1.0  # its message may still be in the pipe
            while r not in got and time.monotonic() < end:
                receive(0.1)
            if r not in got:
                dead[r] = p.exitcode
                failed.append(r)
        if failed:
            give_up = min(give_up, time.monotonic() + FAILURE_GRACE_S)
    running = [r for r in range(world_size) if r not in got and r not in dead]
    dead.update({r: None for r in running})
    if failed:
        # A rank that died without a word is usually the cause; its peers' errors (a connection
        # reset in a collective) the consequence. Otherwise the first error to arrive comes first.
        failed.sort(key=lambda r: r not in dead)
        later = f", then rank(s) {sorted(failed[1:])}" if failed[1:] else ""
        order[:] = failed + running
        return f"rank {failed[0]} failed{later}", False
    if running:
        return f"rank(s) {running} did not finish within {timeout:g} s", True
    return "", False


def _failures(
    order: list[int], got: dict[int, tuple[bool, Any]], dead: Mapping[int, int | None], crash_logs: list[str]
) -> str:
    parts = []
    for r in order:
        if r in got:
            ok, value = got[r]
            if not ok:
                parts.append(f"\n--- rank {r} ---\n{value.rstrip()}")
            continue
        text = f"\n--- rank {r} {_exit_text(dead[r])} ---"
        try:
            with open(crash_logs[r]) as f:
                crash = f.read().strip()
        except OSError:
            crash = ""
        if crash:
            text += f"\n{crash}"
        parts.append(text)
    return "".join(parts)
