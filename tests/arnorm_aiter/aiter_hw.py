"""Rank functions for the ``rocm`` tests: real aiter on AMD GPUs, compared with the reference backend.

``arnorm.testing.run_ranks(..., backend="nccl")`` (RCCL on ROCm) runs them, one GPU per rank.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import arnorm
from arnorm_aiter import _numerics, _rules


def _inputs(world: int, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(tokens, hidden, generator=g).to(dtype).to(device) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    weight = (torch.randn(hidden, generator=g) * 0.2).to(dtype).to(device)
    return partials, residual, weight


def _ops(case: dict[str, Any], max_tokens: int) -> tuple[arnorm.AllReduceNorm, arnorm.AllReduceNorm]:
    kw = {
        "hidden_size": case["hidden"],
        "dtype": case["dtype"],
        "norm": arnorm.RMSNorm(1e-6, case["offset"]),
        "quant": case["quant"],
        "max_tokens": max_tokens,
        "normed_output": case.get("normed", True),
    }
    return (
        arnorm.AllReduceNorm(
            torch.distributed.group.WORLD, backend="aiter", inplace=case.get("inplace", True), **kw
        ),
        arnorm.AllReduceNorm(torch.distributed.group.WORLD, backend="reference", inplace=False, **kw),
    )


def rank_conformance(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case at each token count: aiter's deviation from the reference and any violation."""
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for c, case in enumerate(cases):
        op, ref_op = _ops(case, max(case["tokens"]))
        try:
            for tokens in case["tokens"]:
                partials, residual, weight = _inputs(world, tokens, case["hidden"], case["dtype"], device, c)
                x = partials[rank].clone()
                out = op(x, residual, weight)
                ref = ref_op(partials[rank].clone(), residual, weight)
                torch.cuda.synchronize()
                dev = _numerics.deviation(out, ref)
                problems = _numerics.violations(dev)
                if case.get("inplace", True) and out.residual is not x:
                    problems.append("inplace: residual is not hidden_states")
                one = _rules.use_one_stage(tokens, case["hidden"], 2, world)
                rows.append(
                    {"case": c, "tokens": tokens, "one_stage": one, "dev": str(dev), "problems": problems}
                )
        finally:
            op.close()
            ref_op.close()
    return rows


def rank_graph(rank: int, world: int, hidden: int, tokens: int, zero_copy: bool) -> list[list[str]]:
    """Capture one call in a CUDA graph, replay it on fresh inputs, compare with the reference.

    ``zero_copy``: an ``inplace=False`` op captured inside the backend's ``capture()`` context
    (inputs registered with the peers on exit); otherwise an in-place op captured without it
    (copy into the registered buffer).
    """
    device = torch.device("cuda", torch.cuda.current_device())
    case = {"hidden": hidden, "dtype": torch.bfloat16, "offset": 1.0, "quant": None, "inplace": not zero_copy}
    op, ref_op = _ops(case, tokens)
    backend = op._chain[0]  # the core has no capture hook yet: reach the backend directly
    static_x = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device=device)
    static_res = torch.zeros_like(static_x)
    static_w = torch.zeros(hidden, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(static_x, static_res, static_w)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    context = backend.capture() if zero_copy else contextlib.nullcontext()
    with context, torch.cuda.graph(graph):
        out = op(static_x, static_res, static_w)
    results = []
    for seed in range(3):
        partials, residual, weight = _inputs(world, tokens, hidden, torch.bfloat16, device, 100 + seed)
        static_x.copy_(partials[rank])
        static_res.copy_(residual)
        static_w.copy_(weight)
        graph.replay()
        ref = ref_op(partials[rank].clone(), residual, weight)
        torch.cuda.synchronize()
        results.append(_numerics.violations(_numerics.deviation(out, ref)))
    del graph
    op.close()
    ref_op.close()
    return results
