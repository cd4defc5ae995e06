"""What each spawned rank of ``test_faults_edges.py`` runs (module-level, importable by name):
limits told up front, a store that goes away, subgroups, and the store's key count over many ops.

Every function returns plain data; errors come back as ``("error", type name, message)``.
"""

from __future__ import annotations

import time

import faults_fixtures as ff
import torch.distributed as dist

import arnorm


def attempt(fn):
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def build_twice(rank: int, world: int):
    """Build an op (closing it) twice, timing each attempt."""
    ff.aligned()
    got = []
    for _ in range(2):
        t0 = time.monotonic()
        got.append((attempt(lambda: ff.build().close()), time.monotonic() - t0))
    return got


def store_keys_over_ops(rank: int, world: int, ops: int, check_every: int):
    """The default store's key count after a warm-up op, and after ``ops`` more ops built on WORLD
    (half closed, half dropped without ``close()``; every ``check_every``-th one called once with
    ARNORM_CHECK_CALLS on), with every call's outcome."""
    ff.aligned()
    store = dist.distributed_c10d._get_default_store()
    checked = ff.build(config=arnorm.Config(check_calls=True))
    outcomes = {ff.one_call(checked, rank, world, 0)}
    checked.close()
    dist.barrier()
    before = store.num_keys()
    for i in range(ops):
        op = ff.build()
        if i % check_every == 0:
            outcomes.add(ff.one_call(op, rank, world, i))
        if i % 2:
            op.close()
        del op
    dist.barrier()
    after = store.num_keys()
    return [sorted(outcomes), before, after]


def stall_on_subgroup(rank: int, world: int, where: str):
    """On a subgroup of global ranks [1, 2], global rank 2 (group rank 1) stalls before building
    (``where="construction"``) or before its second call (``"call"``); global rank 1 waits for it."""
    ff.aligned()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    if where == "construction":
        if rank == 2:
            ff.stall(10.0)
            return None
        got = attempt(lambda: ff.build(group=group).close())
        ff.done()
        return got
    op = ff.build(group=group)
    first = ff.one_call(op, rank - 1, 2, 1)
    if rank == 2:
        ff.stall(10.0)
        return first
    second = ff.one_call(op, rank - 1, 2, 2)
    ff.done()
    return second
