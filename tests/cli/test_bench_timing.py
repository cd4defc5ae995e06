"""How `arnorm bench` times a call: one at a time on CPU, and the ranks' agreement before any replay."""

from __future__ import annotations

import pytest
import torch

from arnorm.cli._bench_timing import time_eager, time_graph


def test_eager_restores_the_partial_and_syncs_before_every_call():
    """Each call sees the partial as it was (an in-place all-reduce consumes it), after a sync."""
    source = torch.arange(4.0)
    seen, syncs = [], []

    def fn(partial):
        seen.append(partial.clone())
        partial.mul_(2)

    samples = time_eager(
        fn, (torch.empty(4),), source, warmup=2, iters=3, cuda=False, sync=lambda: syncs.append(1)
    )
    assert len(samples) == 3 and all(us >= 0 for us in samples)
    assert len(seen) == len(syncs) == 5 and all(torch.equal(s, source) for s in seen)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA (capture fails there)")
def test_a_failed_capture_is_agreed_on_and_nothing_is_replayed():
    """A rank whose capture fails votes no, and then no rank replays (their barriers would wait
    forever): the result is the reason, naming the error."""
    votes, syncs = [], []

    def agree(ok: bool) -> bool:
        votes.append(ok)
        return ok

    got = time_graph(lambda p: None, (torch.empty(2),), torch.zeros(2), 1, 5, lambda: syncs.append(1), agree)
    assert isinstance(got, str) and got.startswith("CUDA-graph capture failed (") and "Error" in got
    assert votes == [False] and not syncs
