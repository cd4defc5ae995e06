"""``run_ranks``: run a function on N spawned processes joined in one torch.distributed group.

The parent owns a ``TCPStore`` on port 0 (no free-port race); each child connects, initializes
the default group (gloo on CPU, NCCL when asked and GPUs exist), runs the function and sends its
return value or its traceback back through a queue.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised; the message holds every failing rank's traceback."""


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    queue: Any,
) -> None:
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=_timeout())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_timeout())
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def _timeout() -> Any:
    from datetime import timedelta

    return timedelta(seconds=float(os.environ.get("ARNORM_TEST_TIMEOUT", "120")))


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    env: Sequence[Mapping[str, str]] | Mapping[str, str] | None = None,
    timeout: float = 180.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results in rank order.

    ``fn`` must be importable by name (a module-level function). ``env`` sets environment
    variables in the children, the same for all or one mapping per rank. Raises
    :class:`RankError` with every failing rank's traceback.
    """
    import multiprocessing as mp
    import queue as queue_mod

    import torch.distributed as dist

    per_rank = list(env) if isinstance(env, Sequence) else [env or {}] * world_size
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, store.port, backend, fn, args, per_rank[r], results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < world_size:
            rank, ok, value = results.get(timeout=timeout)
            got[rank] = (ok, value)
    except queue_mod.Empty:
        missing = sorted(set(range(world_size)) - set(got))
        failures = "".join(f"\n--- rank {r} ---\n{v}" for r, (ok, v) in got.items() if not ok)
        raise RankError(f"ranks {missing} did not finish within {timeout:.0f} s{failures}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    if failures:
        raise RankError("\n".join(failures))
    return [got[r][1] for r in range(world_size)]
