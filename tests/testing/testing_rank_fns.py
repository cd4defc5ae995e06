"""Functions the ranks of the arnorm.testing tests run (importable by name, as run_ranks needs)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

#: Whether torch was imported before this module (in a rank: by the fork server, not by the rank).
_TORCH_BEFORE = "torch" in sys.modules

if os.environ.get("TESTING_RANK_FNS_BREAK_IMPORT") == "1":
    raise ImportError("testing_rank_fns: broken on purpose on this rank")


def rank_and_world(rank: int, world: int, extra: object = None) -> tuple[int, int, object]:
    """Return what the rank was given."""
    return rank, world, extra


def fail_on_rank_one(rank: int, world: int) -> str:
    """Rank 1 raises at once; rank 0 waits in a collective that can never complete."""
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one gives up")
    dist.barrier()
    return "unreachable"


def exit_on_rank_one(rank: int, world: int) -> str:
    """Rank 1 leaves without a word (os._exit); rank 0 waits in a collective."""
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.barrier()
    return "unreachable"


def segfault_on_rank_one(rank: int, world: int) -> str:
    """Rank 1 is killed by SIGSEGV; rank 0 waits in a collective."""
    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return "unreachable"


def unpicklable_result(rank: int, world: int) -> object:
    """A return value that cannot travel back to the parent."""
    return lambda: None


def sleep_on_rank_one(rank: int, world: int) -> int:
    """Rank 1 hangs (a stuck kernel, a deadlock); rank 0 returns at once."""
    import time

    if rank == 1:
        time.sleep(3600)
    return rank


def environment_and_path(rank: int, world: int, names: list[str], entry: str) -> tuple[Any, ...]:
    """The values of ``names`` in this rank's environment, whether ``entry`` is on its
    ``sys.path``, and whether torch was already imported before this function's module was."""
    import os
    import sys

    return tuple(os.environ.get(n) for n in names), entry in sys.path, _TORCH_BEFORE


def register_exit_writer(rank: int, world: int, path: str) -> None:
    """An exit handler that writes this rank's number to ``path.<rank>`` when the process ends."""
    import atexit

    def write() -> None:
        with open(f"{path}.{rank}", "w") as f:
            f.write(str(rank))

    atexit.register(write)
