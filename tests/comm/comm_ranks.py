"""What each spawned rank of ``test_comm_rendezvous.py`` runs (module-level, importable by name).

Every function returns plain data; errors come back as ``("error", type name, message)``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import arnorm

from ranks_fixtures import attempt


def _build(group):
    return arnorm.AllReduceNorm(
        group, hidden_size=8, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4,
        backend="reference", device="cpu",
    )  # fmt: skip


def late_after_peers_timed_out(rank: int, world: int, subgroup: bool):
    """The last rank of the group (global rank 2 of [1, 2], or rank 1 of WORLD at TP 2) begins
    building only after its peer's wait timed out; what each got, and how long the late one took."""
    arnorm.backends()
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group([1, 2]) if subgroup else dist.group.WORLD
    if subgroup and rank == 0:
        return None
    late = rank == world - 1
    if not late:
        got = attempt(lambda: _build(group).close())
        store.set("late/peer_gave_up", "1")
        return got
    store.wait(["late/peer_gave_up"])
    t0 = time.monotonic()
    got = attempt(lambda: _build(group).close())
    return got, time.monotonic() - t0


def subgroup_messages(rank: int, world: int):
    """On the subgroup of global ranks [1, 2]: construction with a different hidden size per rank;
    a check-mode call with a different token count per rank; a call that global rank 2 rejects
    (wrong dtype) outside check mode. Each outcome as data."""
    arnorm.backends()
    dist.barrier()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    got = {}

    def build(**kw):
        kw.setdefault("hidden_size", 8)
        return arnorm.AllReduceNorm(group, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4,
                                    backend="reference", device="cpu", **kw)  # fmt: skip

    got["construction"] = attempt(lambda: build(hidden_size=8 * rank).close())
    op = build(config=arnorm.Config(check_calls=True))
    t = rank  # 1 token on global rank 1, 2 on global rank 2
    got["check_calls"] = attempt(lambda: op(torch.ones(t, 8), torch.ones(t, 8), torch.ones(8)) and None)
    op.close()
    op = build()
    dtype = torch.float64 if rank == 2 else torch.float32
    got["rejected"] = attempt(
        lambda: op(torch.ones(2, 8, dtype=dtype), torch.ones(2, 8), torch.ones(8)) and None
    )
    op.close()
    return got


def one_gather_agreements_in_a_row(rank: int, world: int, rounds: int):
    """``rounds`` agreements of one gather each on WORLD (as fuse() and the vLLM routing check make
    them), rank 0 slow to look at each after writing its key (rank 1 done and already at the next
    one by then); what each rank gathered in each round."""
    from arnorm.comm import _rendezvous as rz

    store = dist.distributed_c10d._get_default_store()
    wait = rz.Channel._wait

    def slow(self, *args, **kwargs):
        time.sleep(1.0)
        return wait(self, *args, **kwargs)

    if rank == 0:
        rz.Channel._wait = slow  # type: ignore[method-assign]
    seen = []
    for i in range(rounds):
        channel = rz.Channel(store, (0, 1), rank, 5.0, namespace="arnorm-test")
        seen.append(attempt(lambda c=channel, i=i: c.gather(f"round {i} rank {rank}")))
        channel.done()
    return seen
