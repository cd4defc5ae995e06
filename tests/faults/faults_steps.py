"""What each rank runs in test_faults_steps.py: a call interrupted by a signal, a call rejected on one
rank only, check mode's timeouts and interrupts, inference tensors across ranks.

Most scenarios run under ``run_ranks``; the signal scenarios need the ranks' exit codes, so they run
as plain processes (:func:`launch`, and this file's ``__main__``) that print one ``RESULT`` line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults_fixtures as ff
import torch
import torch.distributed as dist


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


# -- item 2: a call rejected on one rank only -------------------------------------------------------


def rejected_on_some_ranks(rank: int, world: int, rejecting: list[int], calls: int = 4):
    """Call 2 passes a float64 weight on the ranks of ``rejecting`` (rejected there, before any
    collective); every rank goes on calling. Returns every call's outcome, and the seconds call 2
    and the later calls took."""
    ff.aligned()
    op = ff.build()
    got = []
    t0 = time.monotonic()
    for seed in range(1, calls + 1):
        if seed == 2 and rank in rejecting:
            partials, residual, weight = ff.inputs(world, 3, seed)
            got.append(_outcome(lambda p=partials, r=residual, w=weight: op(p[rank].clone(), r, w.double())))
        else:
            got.append(ff.one_call(op, rank, world, seed))
    waited = time.monotonic() - t0
    op.close()
    return [got, waited]


# -- item 6: inference tensors at TP > 1 ------------------------------------------------------------


def inference_tensors(rank: int, world: int, inplace: bool):
    """Inputs made under torch.inference_mode(), the calls made outside it."""
    ff.aligned()
    with ff.build(inplace=inplace) as op:
        got = []
        for seed in range(1, 4):
            with torch.inference_mode():
                partials, residual, weight = ff.inputs(world, 3, seed)
                x = partials[rank].clone()
            got.append(_outcome(lambda a=(partials, x, residual, weight): _checked(op, *a)))
        return got


def _checked(op, partials, x, residual, weight):
    return ("ok", ff.matches(op(x, residual, weight), partials, residual, weight, True))


# -- item 14: check mode ----------------------------------------------------------------------------


def checked_timeout_then_call_again(rank: int, world: int, stall_s: float):
    """Check mode: rank 1 stalls through call 2; rank 0's call 2 times out, then its call 3 must
    raise at once (the op is poisoned), not wait the whole peer timeout again."""
    ff.aligned()
    op = ff.build()
    first = ff.one_call(op, rank, world, 1)
    if rank == 1:
        ff.stall(stall_s)
        op.close()
        return [first, ("stalled",)]
    t0 = time.monotonic()
    second = ff.one_call(op, rank, world, 2)
    t1 = time.monotonic()
    third = ff.one_call(op, rank, world, 3)
    t2 = time.monotonic()
    ff.done()
    op.close()
    return [first, second, third, t1 - t0, t2 - t1]


def checked_interrupt(rank: int, world: int, delay_s: float):
    """Check mode: rank 1 enters call 2 first and gets a SIGINT while it waits in the agreement;
    rank 0 enters call 2 ``delay_s`` later. Rank 0 must learn of it at once, not at the timeout."""
    ff.aligned()
    op = ff.build()
    first = ff.one_call(op, rank, world, 1)
    dist.barrier()
    if rank == 1:
        import threading

        threading.Timer(delay_s / 2, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            second = ff.one_call(op, rank, world, 2)
        except KeyboardInterrupt:
            second = ("interrupted", "KeyboardInterrupt")
        ff.stall(30.0)  # until rank 0 is done: the note must be what ends its wait
        op.close()
        return [first, second]
    time.sleep(delay_s)
    t0 = time.monotonic()
    second = ff.one_call(op, rank, world, 2)
    waited = time.monotonic() - t0
    ff.done()
    op.close()
    return [first, second, waited]


# -- item 1: a signal reaching a rank that waits inside a call ---------------------------------------


def interrupted_in_a_call(rank: int, world: int, how: str) -> dict:
    """Rank 1 enters call 2 first and waits there for rank 0; rank 0 sends it SIGINT (``how`` is
    "sigint") or SIGTERM, which rank 1's handler turns into ``SystemExit(7)`` ("sigterm"), then
    makes its own call 2. What each rank saw, as data."""
    ff.aligned()
    store = dist.distributed_c10d._get_default_store()
    op = ff.build()
    out: dict = {"first": ff.one_call(op, rank, world, 1)}
    dist.barrier()
    if rank == 1:
        if how == "sigterm":

            def leave(signum, frame):
                raise SystemExit(7)

            signal.signal(signal.SIGTERM, leave)
        store.set("steps/pid1", str(os.getpid()))
        try:
            out["second"] = ff.one_call(op, rank, world, 2)
        except KeyboardInterrupt:
            out["second"] = ("interrupted", "KeyboardInterrupt")
        except SystemExit as exc:
            out["second"] = ("exit", exc.code)
            print("RESULT " + json.dumps(out), flush=True)
            raise
        return out
    pid = int(store.get("steps/pid1"))
    time.sleep(1.0)  # rank 1 is waiting inside its call 2
    os.kill(pid, signal.SIGINT if how == "sigint" else signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    out["second"] = ff.one_call(op, rank, world, 2)
    out["waited"] = time.monotonic() - t0
    return out


def launch(how: str, env: dict[str, str], timeout: float = 60.0) -> list[tuple[int, str]]:
    """Run :func:`interrupted_in_a_call` on two plain processes; ``(exit code, output)`` per rank."""
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    here = Path(__file__).resolve().parent
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ARNORM_")}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), environ.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, how, str(rank), "2", str(store.port)],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    got = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\n(killed: timeout)"
        got.append((p.returncode, text))
    del store
    return got


def _main(how: str, rank: int, world: int, port: int) -> None:
    from datetime import timedelta

    wait = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=wait)
    out = interrupted_in_a_call(rank, world, how)
    print("RESULT " + json.dumps(out), flush=True)
    if rank == 0:
        store.set("steps/rank0-done", "1")
    else:
        store.wait(["steps/rank0-done"])  # rank 0's wait ends first: then both let go
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
