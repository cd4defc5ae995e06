"""triton_symm's real synchronization protocol on CPU: ranks are processes, symmetric memory is files
every rank maps (arnorm_triton.symm._emulation.shared_workspace), and the kernel runs under the
Triton interpreter with its flags compiled in (SYNC=True): programs really wait for their peers.

Each rank drives the backend class itself (the part of create() that needs a GPU is skipped), so
the call path, input_buffer's wait kernel, the epochs and the bounded wait are all exercised.
"""

from __future__ import annotations

import time

import pytest
import torch
from triton_cases import check_output, make_problem, make_scale

from arnorm.plugin import Comm, add_rmsnorm, rank_order_sum
from arnorm.testing import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run")]

H = 64
QUANT = "nvfp4"
MAX_TOKENS = 8
SLOTS = 2
#: How late the late rank of the bounded-wait tests is: far longer than its peer takes from the
#: common start to its wait (its first interpreted call), also on a loaded 2-core CI machine
#: running two test workers; 1.5 s was not always.
LATE_S = 4.0


def _layout(world: int, push_max: int):
    from arnorm_triton.symm._workspace import plan_layout

    return plan_layout(world=world, slots=SLOTS, hidden=H, itemsize=2, max_tokens=MAX_TOKENS,
                       max_bytes=1 << 20, oneshot_max=3, push_max=push_max)  # fmt: skip


def _files(tmp_path, world: int, push_max: int = 0) -> str:
    from arnorm_triton.symm._emulation import initial_contents

    for r in range(world):
        (tmp_path / f"rank{r}.buf").write_bytes(initial_contents(_layout(world, push_max)))
    return str(tmp_path)


def rank_calls(rank: int, world: int, directory: str, quant, calls: list[tuple], spin_limit: int,
               push_max: int = 0) -> list:  # fmt: skip
    """Build this rank's backend over the shared files and make ``calls`` (tokens, zero-copy, late
    rank, late seconds); return (failures, the timeout bits after each call, the final epochs)."""
    import torch.distributed as dist

    from arnorm_triton.symm._backend import TritonSymmBackend
    from arnorm_triton.symm._emulation import shared_workspace

    failures, errors = [], []
    problem = make_problem(H, torch.bfloat16, quant, world_size=world, max_tokens=MAX_TOKENS)
    ws = shared_workspace(_layout(world, push_max), torch.bfloat16, directory, rank)
    settings = {"max_bytes": 1 << 20, "oneshot_max_tokens": 3, "spin_limit": spin_limit}
    backend = TritonSymmBackend(problem, Comm(None, torch.device("cpu")), ws, settings)
    # "late" counts from a common start: ranks start up seconds apart on a loaded machine (CI's
    # parallel workers), which would otherwise make the late rank early or its peer later still.
    dist.barrier()
    for i, (t, zero_copy, late_rank, late_s) in enumerate(calls):
        g = torch.Generator().manual_seed(i)
        parts = [torch.randn(t, H, generator=g).to(torch.bfloat16) for _ in range(world)]
        res = torch.randn(t, H, generator=g).to(torch.bfloat16)
        w = (torch.randn(H, generator=g) * 0.1 + 1.0).to(torch.bfloat16)
        s = rank_order_sum(parts)
        scale = make_scale(quant, add_rmsnorm(s, res, w, 1e-6, 0.0)[1])
        if rank == late_rank:
            time.sleep(late_s)
        if zero_copy:
            x = backend.input_buffer(t)
            x.copy_(parts[rank])
        else:
            x = parts[rank].clone()
        out = backend(x, res, w, scale)
        errors.append(int(ws.error.item()))
        try:
            check_output(out, s, res, w, problem, scale)
        except AssertionError as exc:
            failures.append(f"rank {rank} call {i} (T={t}, zero-copy={zero_copy}): {exc}")
    return [failures, errors, ws.epochs.tolist()]


def test_protocol_across_processes(tmp_path):
    """Two ranks: one-shot (T <= 3) and two-shot calls in any order, copy-in and zero-copy (after
    which every call waits at its end), a rank 0.3 s late: every result exact, no wait gives up,
    and both ranks end with the same per-program epochs (one per call that program took part in)."""
    calls = [(3, False, -1, 0.0), (5, False, 1, 0.3), (1, False, -1, 0.0), (7, False, 0, 0.3),
             (5, True, -1, 0.0), (2, True, 1, 0.3), (6, False, -1, 0.0)]  # fmt: skip
    results = run_ranks(2, rank_calls, _files(tmp_path, 2), "fp8_per_token", calls, 1 << 30, timeout=300)
    for failures, errors, _ in results:
        assert not failures, "\n".join(failures)
        assert errors == [0] * len(calls)
    epochs = [r[2] for r in results]
    # Program 0 runs every call; program 1 every call with T >= 2 (then the last call's epochs again:
    # every call here is a flag call).
    counts = [len(calls), sum(1 for c in calls if c[0] >= 2)]
    assert epochs[0] == epochs[1] == counts + counts


def test_push_protocol_across_processes(tmp_path):
    """Two ranks whose one-shot calls (T <= 2) push: the ranks really poll each other's pushes, a
    rank 0.3 s late included, mixed with flag calls (T = 3 one-shot, two-shot, zero-copy) that must
    wait for the right epoch of DONE although push calls signal none: every result exact, no wait
    gives up."""
    calls = [(2, False, -1, 0.0), (1, False, 1, 0.3), (3, False, -1, 0.0), (2, False, 0, 0.3),
             (6, False, -1, 0.0), (1, True, -1, 0.0), (3, True, 1, 0.3), (2, False, -1, 0.0)]  # fmt: skip
    results = run_ranks(2, rank_calls, _files(tmp_path, 2, 2), QUANT, calls, 1 << 30, 2, timeout=300)
    for failures, errors, _ in results:
        assert not failures, "\n".join(failures)
        assert errors == [0] * len(calls)
    assert results[0][2] == results[1][2]


def test_bounded_push_wait_records_the_timeout(tmp_path):
    """A push wait gives up after the spin limit (bit 3 of the error word) instead of hanging."""
    calls = [(1, False, 1, LATE_S)]
    results = run_ranks(2, rank_calls, _files(tmp_path, 2, 2), None, calls, 50, 2, timeout=300)
    (_, errors0, _), (_, errors1, _) = results
    assert errors0[0] & 8 and errors1 == [0]


def test_protocol_three_ranks(tmp_path):
    """Three ranks (an odd world: two-shot ownership rotates over programs) stay exact."""
    calls = [(7, False, -1, 0.0), (2, False, 2, 0.2), (6, True, -1, 0.0)]
    results = run_ranks(3, rank_calls, _files(tmp_path, 3), None, calls, 1 << 30, timeout=300)
    for failures, errors, _ in results:
        assert not failures, "\n".join(failures)
        assert errors == [0] * len(calls)


def test_bounded_wait_records_the_timeout(tmp_path):
    """With a spin limit of 50 polls, a rank LATE_S seconds late makes the other rank's publish wait give up
    (bit 0 of the error word) instead of hanging; the late rank, whose peer already signalled, does not."""
    calls = [(3, False, 1, LATE_S)]
    results = run_ranks(2, rank_calls, _files(tmp_path, 2), None, calls, 50, timeout=300)
    (_, errors0, _), (_, errors1, _) = results
    assert errors0[0] & 1 and errors1 == [0]
