"""Functions the spawned ranks of the flashinfer tests run (importable by name, as ``run_ranks`` needs).

CPU ranks install the recording fake; GPU ranks (``gpu_*``) use the real FlashInfer.
"""

from __future__ import annotations

from typing import Any

import torch

MIB = 1 << 20


def use_registry() -> None:
    """Exactly the reference and flashinfer backends, whatever entry points this install has."""
    from arnorm.registry import _builtin
    from arnorm.registry._discovery import Registry, reset_registry
    from arnorm_flashinfer import _plugin

    registry = Registry()
    registry.add_from_hook("arnorm", _builtin.arnorm_backends)
    registry.add_from_hook("flashinfer", _plugin.arnorm_backends)
    reset_registry(registry)


def pretend_cuda(arch: tuple[int, int]) -> None:
    """Make ``AllReduceNorm`` describe a CPU op as a CUDA one of ``arch`` (the fake runs on CPU)."""
    import arnorm.op._args

    arnorm.op._args.platform_of = lambda device: ("cuda", arch, None)


def make_inputs(
    rank: int, world: int, tokens: int, hidden: int, dtype: torch.dtype, device: Any = "cpu", seed=0
):
    g = torch.Generator().manual_seed(seed + tokens)
    partials = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.1).to(dtype)
    return [p.to(device) for p in partials], residual.to(device), weight.to(device)


def reference(partials, residual, weight, eps, offset, quant, scale, layout):
    from arnorm._reference import add_rmsnorm, quantize_output, rank_order_sum

    h, y = add_rmsnorm(rank_order_sum(partials), residual, weight, eps, offset)
    return h, y, quantize_output(y, quant, scale, layout)


# -- CPU ranks with the fake -----------------------------------------------------------------


def agree_on_failure(rank: int, world: int) -> tuple[str, list[Any]]:
    """Rank 1's JIT build fails: every rank must raise the same error and none may enter the collective."""
    import torch.distributed as dist
    from fake_flashinfer import install, make_problem

    from arnorm._errors import BackendSetupError
    from arnorm.comm._comm import Comm
    from arnorm_flashinfer._backend import FlashInferBackend
    from arnorm_flashinfer._plugin import FlashInferSettings

    state = install(None, fail_build="nvcc not found" if rank == 1 else None)
    comm = Comm(dist.group.WORLD, torch.device("cpu"))
    try:
        FlashInferBackend.create(make_problem(world_size=world), comm, FlashInferSettings())
    except BackendSetupError as exc:
        return str(exc), state.creates
    return "created", state.creates


#: (quant, scale layout) cases ``cpu_suite`` runs through the op.
CPU_CASES: tuple[tuple[str | None, str | None], ...] = (
    (None, None),
    ("fp8_static", None),
    ("fp8_per_token", None),
    ("nvfp4", None),
    ("nvfp4", "linear"),
    ("mxfp8", "swizzled_128x4"),
)


def cpu_suite(rank: int, world: int) -> dict[str, Any]:
    """Everything the CPU multi-rank tests check, in one spawn (spawning ranks is the slow part)."""
    out: dict[str, Any] = {"failure": agree_on_failure(rank, world)}
    for quant, layout in CPU_CASES:
        out[f"{quant}/{layout}"] = through_the_op(rank, world, quant, layout)
    return out


def through_the_op(rank: int, world: int, quant: str | None, layout: str | None) -> dict[str, Any]:
    """Selection, explain and a call through ``arnorm.AllReduceNorm`` with the fake flashinfer."""
    from fake_flashinfer import install

    import arnorm

    state = install(None)
    use_registry()
    pretend_cuda((10, 0) if quant == "nvfp4" else (9, 0))
    hidden, dtype, eps, offset = 64, torch.bfloat16, 1e-6, 1.0
    config = arnorm.Config(
        settings={"flashinfer": {"max_size_mb": 8 * hidden * 2 / MIB}}
    )  # 8 tokens per call at most
    op = arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=hidden,
        dtype=dtype,
        norm=arnorm.RMSNorm(eps, offset),
        quant=quant,
        scale_layout=layout,
        max_tokens=16,
        device="cpu",
        config=config,
    )
    result: dict[str, Any] = {"backend": op.backend, "explain": str(op.explain())}
    result["explain12"] = str(op.explain(num_tokens=12))
    result["backend_for"] = (op.backend_for(5), op.backend_for(12))
    scale = torch.tensor([0.03]) if quant in ("fp8_static", "nvfp4") else None
    checks = []
    for tokens in (1, 5, 8, 12):
        partials, residual, weight = make_inputs(rank, world, tokens, hidden, dtype)
        x = partials[rank].clone()
        out = op(x, residual, weight, scale)
        h, y, q = reference(partials, residual, weight, eps, offset, quant, scale, op.problem.scale_layout)
        ok = out.residual is x and torch.equal(out.residual, h) and torch.equal(out.normed, y)
        if q is not None:
            ok = ok and torch.equal(out.quant.data.view(torch.uint8), q.data.view(torch.uint8))
            ok = ok and torch.equal(out.quant.scale.view(torch.uint8), q.scale.view(torch.uint8))
            ok = ok and out.quant.layout == q.layout
        checks.append((tokens, bool(ok)))
    result["checks"] = checks
    (create,) = state.creates
    result["create"] = {k: create[k] for k in ("backend", "world_size", "rank", "max_token_num")}
    result["group_is_world"] = create["group"] is torch.distributed.group.WORLD
    result["fused_calls"] = len(state.calls)
    op.close()
    result["destroyed"] = [w.destroy_count for w in state.workspaces]
    return result


# -- GPU ranks with the real FlashInfer ------------------------------------------------------


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ulp distance: arnorm.testing's one measure."""
    from arnorm.testing import ulps

    return ulps(a, b)


def _code_distance(a: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "nvfp4":  # two e2m1 codes per byte, sign in bit 3
        ua, ub = a.view(torch.uint8).long(), b.view(torch.uint8).long()
        out = []
        for shift in (0, 4):
            na, nb = (ua >> shift) & 0xF, (ub >> shift) & 0xF
            na = torch.where(na >= 8, -(na - 8), na)
            nb = torch.where(nb >= 8, -(nb - 8), nb)
            out.append((na - nb).abs())
        return torch.stack(out)
    ia, ib = a.view(torch.int8).long(), b.view(torch.int8).long()
    ia = torch.where(ia < 0, -(ia + 128), ia)
    ib = torch.where(ib < 0, -(ib + 128), ib)
    return (ia - ib).abs()


def gpu_conformance(
    rank: int, world: int, dtype_name: str, quant: str | None, layout: str | None, offset: float
) -> dict[str, Any]:
    """The real kernel against the reference: residual bitwise, normed <= 1 ulp, quant codes <= 1 apart.

    A 40 MiB budget lets the largest call run two-shot at TP 2 (above 32 MiB on SM90) and TP 4+.
    """
    import arnorm
    from arnorm import quant as Q

    use_registry()
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, dtype_name)
    hidden, eps = 4096, 1e-6
    op = arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=hidden,
        dtype=dtype,
        norm=arnorm.RMSNorm(eps, offset),
        quant=quant,
        scale_layout=layout,
        max_tokens=4200,
        backend="flashinfer",
        device=device,
        config=arnorm.Config(settings={"flashinfer": {"max_size_mb": 40}}),
    )
    # fp8_static: the dequant scale; nvfp4: the global encode scale 448 * 6 / amax for |y| <= 8.
    scale_value = {"fp8_static": 0.05, "nvfp4": 448 * 6 / 8.0}.get(quant or "")
    scale = None if scale_value is None else torch.tensor([scale_value], device=device)
    stats = []
    for tokens in (1, 3, 64, 511, 4100):
        partials, residual, weight = make_inputs(rank, world, tokens, hidden, dtype, device)
        x = partials[rank].clone()
        out = op(x, residual, weight, scale)
        h, y, q = reference(partials, residual, weight, eps, offset, quant, scale, op.problem.scale_layout)
        row = {
            "tokens": tokens,
            "oneshot": op._chain[0]._oneshot.get(tokens),
            "residual_equal": bool(torch.equal(out.residual, h)),
            "normed_max_ulp": int(_ulps(out.normed, y).max()),
        }
        if q is not None:
            ref_q = Q.quantize(out.normed, quant, scale=scale, layout=op.problem.scale_layout)
            dist = _code_distance(out.quant.data, ref_q.data, quant)
            row["code_mismatch_fraction"] = float((dist > 0).float().mean())
            row["code_max_distance"] = int(dist.max())
            same_scale = out.quant.scale.view(torch.uint8) == ref_q.scale.view(torch.uint8)
            row["scale_mismatch_fraction"] = float((~same_scale).float().mean())
        stats.append(row)
    op.close()
    return {"backend": "flashinfer", "stats": stats}


def gpu_graph_capture(rank: int, world: int) -> bool:
    """Capture three calls in a CUDA graph, replay with new data, compare with the reference."""
    import arnorm

    use_registry()
    device = torch.device("cuda", torch.cuda.current_device())
    dtype, hidden, tokens, eps = torch.bfloat16, 2048, 32, 1e-6
    op = arnorm.AllReduceNorm(
        torch.distributed.group.WORLD,
        hidden_size=hidden,
        dtype=dtype,
        norm=arnorm.RMSNorm(eps, 0.0),
        quant="fp8_static",
        max_tokens=64,
        backend="flashinfer",
        device=device,
    )
    scale = torch.tensor([0.05], device=device)
    xs = [torch.empty(tokens, hidden, dtype=dtype, device=device) for _ in range(3)]
    res = torch.empty(tokens, hidden, dtype=dtype, device=device)
    w = torch.empty(hidden, dtype=dtype, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs:
            op(x, res, w, scale)  # warm-up: dispatch caches, lazy init
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [op(x, res, w, scale) for x in xs]
    ok = True
    for seed in (1, 2):
        parts = []
        for i, x in enumerate(xs):
            partials, residual, weight = make_inputs(
                rank, world, tokens, hidden, dtype, device, seed=seed * 10 + i
            )
            x.copy_(partials[rank])
            parts.append(partials)
        res.copy_(residual)
        w.copy_(weight)
        graph.replay()
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            h, y, _ = reference(parts[i], residual, weight, eps, 0.0, None, None, None)
            ok = ok and torch.equal(out.residual, h) and int(_ulps(out.normed, y).max()) <= 1
    op.close()
    return bool(ok)


def gpu_create_destroy(rank: int, world: int, rounds: int) -> list[int]:
    """Build and close ops repeatedly (sharing and not); return the live workspaces after each round."""
    import arnorm
    from arnorm_flashinfer import _workspace

    use_registry()
    device = torch.device("cuda", torch.cuda.current_device())
    live = []
    for i in range(rounds):
        ops = [
            arnorm.AllReduceNorm(
                torch.distributed.group.WORLD,
                hidden_size=hidden,
                dtype=torch.bfloat16,
                max_tokens=64,
                backend="flashinfer",
                device=device,
            )
            for hidden in (1024, 1024, 2048 + 1024 * (i % 2))
        ]
        for op in ops:
            partials, residual, weight = make_inputs(
                rank, world, 8, op.problem.hidden_size, torch.bfloat16, device
            )
            op(partials[rank].clone(), residual, weight)
        torch.cuda.synchronize()
        for op in ops:
            op.close()
        live.append(len(_workspace.live_entries()))
    return live
