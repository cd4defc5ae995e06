"""What each spawned rank of ``test_faults_edges.py`` runs (module-level, importable by name):
limits told up front, a store that goes away, subgroups, and the store's key count over many ops.

Every function returns plain data; errors come back as ``("error", type name, message)``.
"""

from __future__ import annotations

import time

import faults_fixtures as ff
import torch.distributed as dist

import arnorm

from ranks_fixtures import attempt


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


def _host_store(queue) -> None:
    """A process hosting a c10d store, standing in for the rank that hosts it (rank 0 of a job)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue.put(store.port)
    time.sleep(600)


def store_host_dies(rank: int, world: int, check_calls: bool):
    """Every rank re-initializes its default group over a store that a helper process of rank 0
    hosts, builds an op and calls it; then the helper is killed (the store's host died), and each
    rank calls the op again and builds another: what each did, with how long it took."""
    import multiprocessing as mp
    from datetime import timedelta

    ff.aligned()
    parent = dist.distributed_c10d._get_default_store()
    host = None
    if rank == 0:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        host = ctx.Process(target=_host_store, args=(queue,), daemon=True)
        host.start()
        parent.set("edges/port", str(queue.get()))
    port = int(parent.get("edges/port"))
    wait = timedelta(seconds=20)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=wait)
    op = ff.build(config=arnorm.Config(check_calls=check_calls))
    got = [ff.one_call(op, rank, world, 1)]
    parent.add("edges/built", 1)
    while int(parent.add("edges/built", 0)) < world:
        time.sleep(0.05)
    if host is not None:
        host.kill()
        host.join()
        parent.set("edges/gone", "1")
    parent.wait(["edges/gone"])
    for step in (lambda: ff.one_call(op, rank, world, 2), lambda: ff.build().close()):
        t0 = time.monotonic()
        outcome = attempt(step)
        if outcome[0] == "ok" and isinstance(outcome[1], tuple):
            outcome = outcome[1]
        got.append((outcome, time.monotonic() - t0))
    op.close()
    return got


def refused_twice_with_rank1_slow_to_look(rank: int, world: int):
    """Both ranks build an op that every rank refuses (the same error, agreed), twice. Rank 1 is
    slow to look for its peer's key in the first attempt (a busy host): rank 0 has already raised
    and begun its second attempt by then."""
    from arnorm.comm import _rendezvous

    ff.aligned()
    real = _rendezvous.Channel._wait
    slow = [rank == 1]

    def late_look(self, *args):
        if slow[0]:
            slow[0] = False
            time.sleep(1.0)
        return real(self, *args)

    _rendezvous.Channel._wait = late_look  # type: ignore[method-assign]
    got = [attempt(lambda: ff.build(quant="bogus").close()) for _ in range(2)]
    _rendezvous.Channel._wait = real  # type: ignore[method-assign]
    got.append(attempt(lambda: ff.build().close()))
    return got
