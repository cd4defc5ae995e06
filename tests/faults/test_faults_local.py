"""Faults within one process: fused_allreduce_norm from two threads on LOCAL, fork of a LOCAL op."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest
import torch

import arnorm
from arnorm._reference import add_rmsnorm

import fake_backends


@pytest.fixture(autouse=True)
def _reference_only():
    fake_backends.install()


def test_fused_allreduce_norm_from_two_threads_on_local_works(clean_env):
    """On LOCAL the helper serializes its calls: every result from both threads is the contract's."""
    wrong, errors = [], []

    def work(i):
        g = torch.Generator().manual_seed(i)
        for _ in range(30):
            x, r, w = (
                torch.randn(2 + i, 16, generator=g),
                torch.randn(2 + i, 16, generator=g),
                torch.randn(16),
            )
            want_h, want_y = add_rmsnorm(x.clone(), r, w, 1e-6, 0.0)
            try:
                out = arnorm.fused_allreduce_norm(x, r, w, group=arnorm.LOCAL, eps=1e-6)
            except Exception as exc:
                errors.append(exc)
                continue
            if not (torch.equal(out.residual, want_h) and torch.equal(out.normed, want_y)):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not wrong


def test_an_op_used_in_a_forked_child_raises_at_once(clean_env):
    """Even at TP 1 the child's copy of the op is poisoned: it raises PeerError instead of running."""
    op = arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=16, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4,
        device="cpu",  # CPU tensors below, also on a host with GPUs
    )  # fmt: skip
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()

    def child():
        try:
            op(torch.randn(2, 16), torch.randn(2, 16), torch.ones(16))
            queue.put("no error")
        except arnorm.PeerError as exc:
            queue.put(str(exc))
        os._exit(0)

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    message = queue.get()
    assert message.startswith(f"op: used in process {proc.pid}, a fork of process {os.getpid()}"), message
    out = op(torch.randn(2, 16), torch.randn(2, 16), torch.ones(16))  # the parent's op is untouched
    assert out.normed is not None
    op.close()
