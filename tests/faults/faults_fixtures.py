"""What each spawned rank of the fault suite runs (module-level, importable by name).

Every function returns plain data describing what each call did: ``("ok", correct)`` for a result
(``correct`` compares it bitwise with the contract computed from every rank's partial), or
``("error", type name, message)``. A test then asserts that no rank ever got an incorrect result
and that the errors are the clear ones.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

import arnorm
from arnorm._reference import add_rmsnorm, rank_order_sum

H = 16
EPS = 1e-6
#: Where the ops and tensors live: "cpu" (gloo ranks), or "cuda" for the multigpu variants.
DEVICE = os.environ.get("FAULTS_DEVICE", "cpu")


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")


def inputs(world: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(tokens, H, generator=g).to(device()) for _ in range(world)]
    residual = torch.randn(tokens, H, generator=g).to(device())
    weight = (torch.randn(H, generator=g) * 0.1).to(device())
    return partials, residual, weight


def aligned() -> None:
    """Discover the backends, then wait for every rank: the short peer timeouts of these tests
    then measure the fault, not one rank's slower start-up."""
    arnorm.backends()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def store_barrier(key: str, world: int) -> None:
    """Wait until every rank has reached this point, through the default store (not a collective:
    the group may hold a collective a timed-out peer left behind)."""
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    while int(store.add(key, 0)) < world:
        time.sleep(0.01)


def stall(seconds: float) -> None:
    """Stall (a debugger, a slow host) until rank 0 says it is done, at most ``seconds``."""
    store = dist.distributed_c10d._get_default_store()
    end = time.monotonic() + seconds
    while time.monotonic() < end and not store.check(["faults/done"]):
        time.sleep(0.05)


def done() -> None:
    dist.distributed_c10d._get_default_store().set("faults/done", "1")


def build(group=None, backend: str = "reference", **kw) -> arnorm.AllReduceNorm:
    return arnorm.AllReduceNorm(
        dist.group.WORLD if group is None else group,
        hidden_size=H,
        dtype=torch.float32,
        norm=arnorm.RMSNorm(EPS),
        max_tokens=8,
        backend=backend,
        device=device(),  # CPU by default, also on a host with GPUs
        **kw,
    )


def matches(out, partials, residual, weight, exact: bool) -> bool:
    """``out`` is the contract's result for these partials: bitwise (the reference), or within
    fp32 rounding (a kernel's own reduction order); a step paired with another step's data is off
    by far more."""
    h, y = add_rmsnorm(rank_order_sum(partials), residual, weight, EPS, 0.0)
    if exact:
        return torch.equal(out.residual, h) and torch.equal(out.normed, y)
    return torch.allclose(out.residual, h, rtol=1e-5, atol=1e-5) and torch.allclose(
        out.normed, y, rtol=1e-4, atol=1e-4
    )


def one_call(op, rank: int, world: int, seed: int, tokens: int = 3):
    """Call ``op`` with step ``seed``'s inputs; what happened, as data."""
    partials, residual, weight = inputs(world, tokens, seed)
    x = partials[rank].clone()
    exact = op.backend == "reference"
    try:
        out = op(x, residual, weight)
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))
    return ("ok", matches(out, partials, residual, weight, exact))


def raise_once_then_continue(rank: int, world: int, backend: str, fail_at: int, calls: int):
    """Rank 1's backend raises MemoryError once (before its collective); every rank goes on calling,
    then builds a new op and calls it once."""
    aligned()
    op = build(backend=backend)
    impl_type = type(op._chain[0])
    real = impl_type.__call__
    count = [0]

    def flaky(self, *args, **kw):
        count[0] += 1
        if rank == 1 and count[0] == fail_at:
            raise MemoryError("injected: out of memory on rank 1")
        return real(self, *args, **kw)

    impl_type.__call__ = flaky
    got = [one_call(op, rank, world, seed) for seed in range(calls)]
    impl_type.__call__ = real
    op.close()
    with build(backend=backend) as fresh:
        got.append(one_call(fresh, rank, world, 100))
    return got


def raise_after_the_collective(rank: int, world: int, fail_at: int, calls: int):
    """Rank 1's reference backend raises once right after its all-gather in call ``fail_at``: the
    peers' call ``fail_at`` completes, and the poison tells them which call failed."""
    from arnorm.comm._comm import Comm

    aligned()
    op = build(backend="reference")
    real = Comm.all_gather
    count = [0]

    def gather_then_fail(self, tensor):
        parts = real(self, tensor)
        count[0] += 1
        if rank == 1 and count[0] == fail_at:
            raise MemoryError("injected: out of memory on rank 1, after the collective")
        return parts

    Comm.all_gather = gather_then_fail
    try:
        got = [one_call(op, rank, world, seed) for seed in range(calls)]
    finally:
        Comm.all_gather = real
    op.close()
    return got


def two_ops_two_threads(rank: int, world: int, calls: int):
    """Two ops on one group, each called from its own thread at the same time."""
    aligned()
    ops = [build(), build()]
    got: list = [[], []]

    def work(i):
        for seed in range(calls):
            got[i].append(one_call(ops[i], rank, world, seed + 1000 * i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def extra_op_while_calling(rank: int, world: int):
    """Rank 1 builds a second op while rank 0 calls the first one; then both build and call."""
    aligned()
    op = build()
    first = one_call(op, rank, world, 1)
    if rank == 0:
        second = one_call(op, rank, world, 2)
    else:
        # Rank 1 starts building well inside rank 0's wait, so rank 0's call gives up first (rank 1
        # then learns it and fails at once): two waits of one peer timeout begun together would race,
        # and on a loaded machine either could end first.
        time.sleep(float(os.environ["ARNORM_PEER_TIMEOUT"]) / 2)
        try:
            build().close()
            second = ("ok", "built")
        except Exception as exc:
            second = ("error", type(exc).__name__, str(exc))
    # Both ranks are past their failed step before either builds again: rank 0's next construction
    # must not meet rank 1's extra one while that one still waits.
    store_barrier("faults/extra-op-step-2", world)
    try:
        with build() as again:
            third = one_call(again, rank, world, 3)
    except Exception as exc:
        third = ("error", type(exc).__name__, str(exc))
    return [first, second, third]


def stall_before_call(rank: int, world: int, stall_s: float):
    """Rank 1 stalls before its second call (a debugger, a slow host); rank 0 waits for it."""
    aligned()
    op = build()
    first = one_call(op, rank, world, 1)
    t0 = time.monotonic()
    if rank == 1:
        stall(stall_s)
        return [first, ("stalled",)]
    second = one_call(op, rank, world, 2)
    waited = time.monotonic() - t0
    if rank == 0:
        done()
    return [first, second, waited]


def stall_in_construction(rank: int, world: int, stall_s: float):
    """Rank 1 stalls before building; rank 0's construction waits for it."""
    aligned()
    if rank == 1:
        stall(stall_s)
        return [("stalled",)]
    t0 = time.monotonic()
    try:
        build().close()
        got = ("ok", "built")
    except Exception as exc:
        got = ("error", type(exc).__name__, str(exc))
    waited = time.monotonic() - t0
    done()
    return [got, waited]


def different_group_objects(rank: int, world: int):
    """Rank 0 passes WORLD, rank 1 a new_group of the same members."""
    aligned()
    sub = dist.new_group(list(range(world)))
    group = dist.group.WORLD if rank == 0 else sub
    t0 = time.monotonic()
    try:
        with build(group=group) as op:
            got = one_call(op, rank, world, 1)
    except Exception as exc:
        got = ("error", type(exc).__name__, str(exc))
    return [got, time.monotonic() - t0]


def forked_child_calls(rank: int, world: int):
    """Each rank forks after building; the child calls the parent's op (and must raise at once)."""
    aligned()
    import multiprocessing as mp

    op = build()
    first = one_call(op, rank, world, 1)
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()

    def child():
        queue.put(one_call(op, rank, world, 2))
        os._exit(0)

    proc = ctx.Process(target=child)
    t0 = time.monotonic()
    proc.start()
    proc.join(20)
    alive = proc.is_alive()
    if alive:
        proc.kill()
        proc.join()
    in_child = None if alive else queue.get()
    # The parent's op is untouched: it still pairs with the other rank's.
    after = one_call(op, rank, world, 3)
    op.close()
    return [first, in_child, after, time.monotonic() - t0]


def interrupted_construction(rank: int, world: int, where: str):
    """A KeyboardInterrupt inside rank 1's construction (at ``where``), then both ranks build again."""
    aligned()
    import arnorm.registry._select as sel

    real = getattr(sel, where)
    fired = [False]

    def interrupt(*args, **kw):
        if rank == 1 and not fired[0]:
            fired[0] = True
            raise KeyboardInterrupt
        return real(*args, **kw)

    setattr(sel, where, interrupt)
    try:
        build().close()
        first = ("ok", "built")
    except KeyboardInterrupt:
        first = ("interrupted",)
    except Exception as exc:
        first = ("error", type(exc).__name__, str(exc))
    setattr(sel, where, real)
    got = [first]
    for seed in (1, 2):  # both build again, twice: each must work
        try:
            with build() as op:
                got.append(one_call(op, rank, world, seed))
        except Exception as exc:
            got.append(("error", type(exc).__name__, str(exc)))
    return got


def fused_over_budget_on_one_rank(rank: int, world: int):
    """fused_allreduce_norm: rank 0 calls with more tokens than the cached op's budget, rank 1 within it."""
    aligned()
    from arnorm.op._oneshot import fused_allreduce_norm

    def fused(tokens, seed):
        partials, residual, weight = inputs(world, tokens, seed)
        try:
            out = fused_allreduce_norm(
                partials[rank].clone(), residual, weight, group=dist.group.WORLD, eps=EPS
            )
        except Exception as exc:
            return ("error", type(exc).__name__, str(exc))
        return ("ok", matches(out, partials, residual, weight, exact=False))

    got = [fused(3, 1)]
    got.append(fused(9000 if rank == 0 else 3, 2))
    got.append(fused(3, 3))
    got.append(fused(4, 4))
    return got


def fused_from_two_threads(rank: int, world: int, calls: int):
    """fused_allreduce_norm called from two threads at once on the same group."""
    aligned()
    from arnorm.op._oneshot import fused_allreduce_norm

    got: list = [[], []]

    def work(i):
        for seed in range(calls):
            partials, residual, weight = inputs(world, 2 + i, seed + 1000 * i)
            try:
                out = fused_allreduce_norm(
                    partials[rank].clone(), residual, weight, group=dist.group.WORLD, eps=EPS
                )
            except Exception as exc:
                got[i].append(("error", type(exc).__name__, str(exc)))
                continue
            got[i].append(("ok", matches(out, partials, residual, weight, exact=False)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def fused_recovers_after_a_failed_call(rank: int, world: int):
    """fused_allreduce_norm: rank 1's backend raises once; the next call rebuilds on every rank."""
    aligned()
    from arnorm.op import _oneshot

    def fused(seed):
        partials, residual, weight = inputs(world, 3, seed)
        try:
            out = _oneshot.fused_allreduce_norm(
                partials[rank].clone(), residual, weight, group=dist.group.WORLD, eps=EPS
            )
        except Exception as exc:
            return ("error", type(exc).__name__, str(exc))
        return ("ok", matches(out, partials, residual, weight, exact=False))

    got = [fused(1)]
    (op,) = _oneshot._cache.values()
    impl_type = type(op._chain[0])
    real = impl_type.__call__

    def failing(self, *args, **kw):
        impl_type.__call__ = real
        raise MemoryError("injected: out of memory on rank 1")

    if rank == 1:
        impl_type.__call__ = failing
    got += [fused(2), fused(3), fused(4)]
    return got
