"""How ``arnorm bench`` times one call on every rank: CUDA-graph replay on GPUs, one call at a time
on CPU (and on GPUs with ``--eager``, or where a graph cannot be captured).

A GPU call timed alone, after a device synchronization and a barrier, measures the host's launch
and the ranks' skew as much as the kernel: the barrier releases ranks tens of microseconds apart
and a collective waits for the last one. Engines replay CUDA graphs; so does the bench. Each rank
captures ``calls`` calls (the partial restored before each, as an in-place all-reduce consumes it),
and per sample every rank synchronizes, passes the barrier, and replays the graph; the sample is
the replay's time over ``calls``, less the restore copies' own per-call time (a graph of the copies
alone, timed the same way). A late rank's skew is then paid once per ``calls`` calls.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["GRAPH_CALLS", "time_eager", "time_graph"]

#: Calls captured per graph: a rank's skew at the barrier is spread over this many calls.
GRAPH_CALLS = 20


def time_eager(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    source: torch.Tensor,
    warmup: int,
    iters: int,
    cuda: bool,
    sync: Callable[[], None],
) -> list[float]:
    """Microseconds of each of ``iters`` calls ``fn(*args)``, one at a time: ``args[0]`` (the
    partial) restored from ``source``, then ``sync()`` (device and every rank), then CUDA events
    around the call on a GPU, ``time.perf_counter`` on CPU."""
    samples: list[float] = []
    for i in range(warmup + iters):
        args[0].copy_(source)
        sync()
        if cuda:
            us = _event_us(lambda: fn(*args))
        else:
            t0 = time.perf_counter()
            fn(*args)
            us = (time.perf_counter() - t0) * 1e6
        if i >= warmup:
            samples.append(us)
    return samples


def _event_us(run: Callable[[], Any]) -> float:
    """Microseconds between CUDA events recorded on the current stream around ``run()``."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3


def _replays(graph: Any, replays: int, calls: int, sync: Callable[[], None]) -> list[float]:
    samples = []
    for _ in range(replays):
        sync()
        samples.append(_event_us(graph.replay) / calls)
    return samples


def time_graph(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    source: torch.Tensor,
    warmup: int,
    replays: int,
    sync: Callable[[], None],
    agree: Callable[[bool], bool],
    calls: int = GRAPH_CALLS,
) -> tuple[list[float], float] | str:
    """``(samples, restore_us)``: per-call microseconds of ``replays`` replays of a CUDA graph of
    ``calls`` calls ``args[0].copy_(source); fn(*args)`` (each sample less ``restore_us``, the
    median per-call time of a graph of the copies alone, floored at 0); or why no graph could be
    captured, on any rank (``agree(ok)`` is True only when every rank's ``ok`` is: then every rank
    replays, else none does, so the barriers of the replays pair up). ``warmup`` eager calls run
    first on the capture's side stream (compiles and allocates outside the capture). Every rank
    calls this with the same arguments: the captured collectives pair up across ranks."""
    import torch

    cuda = torch.cuda
    graph: Any = None
    copies: Any = None
    why = ""
    try:
        graph, copies = cuda.CUDAGraph(), cuda.CUDAGraph()
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            for _ in range(max(1, warmup)):
                args[0].copy_(source)
                fn(*args)
        cuda.current_stream().wait_stream(side)
        cuda.synchronize()
        with cuda.graph(graph):
            for _ in range(calls):
                args[0].copy_(source)
                fn(*args)
        with cuda.graph(copies):
            for _ in range(calls):
                args[0].copy_(source)
    except Exception as exc:  # a backend that is not graph-safe: timed eagerly, and said so
        why = f"{type(exc).__name__}: {str(exc).strip()[:160]}"
    if not agree(not why):
        return f"CUDA-graph capture failed ({why or 'on another rank'})"
    _replays(graph, 1, calls, sync)  # the first replay uploads the graph
    restore = statistics.median(_replays(copies, max(3, replays // 4), calls, sync))
    samples = [max(0.0, us - restore) for us in _replays(graph, replays, calls, sync)]
    return samples, restore
