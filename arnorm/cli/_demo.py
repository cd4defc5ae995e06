"""``arnorm demo``: a small tensor-parallel decoder stack whose every row-parallel output goes
through ``AllReduceNorm``, checked layer by layer against the unfused torch path.

(``arnorm demo --model`` runs a real architecture instead: :mod:`arnorm.cli._demo_model`.)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from arnorm._formats import FORMAT_SPECS, QUANT_FORMATS

__all__ = ["DEFAULTS", "pick_device", "run"]

#: Values of the synthetic stack's options when not given (``None`` on the command line, so that
#: ``--model`` can tell which were given).
DEFAULTS = {"layers": 4, "tokens": 16, "hidden": 256, "quant": QUANT_FORMATS[0]}


def pick_device(device: str, tp: int) -> str:
    """``"cuda"`` or ``"cpu"`` for ``--device`` (auto: CUDA when at least ``tp`` GPUs are visible);
    raises the CLI's ``UsageError`` for ``cuda`` on a machine without CUDA."""
    import torch

    from arnorm.cli._usage import UsageError

    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise UsageError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if device == "auto":
        return "cuda" if has_cuda and torch.cuda.device_count() >= tp else "cpu"
    return device


def _unfused(
    partial: Any,
    residual: Any,
    weight: Any,
    eps: float,
    offset: float,
    quant: str | None,
    scale: Any,
    layout: str | None,
) -> tuple[Any, Any, Any]:
    """What an engine writes by hand: all_reduce, then add + RMSNorm + quant in plain torch."""
    import torch
    import torch.distributed as dist

    from arnorm._reference import quantize_output

    summed = partial.float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(summed)
    h = (summed.to(partial.dtype).float() + residual.float()).to(partial.dtype)
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)).to(
        partial.dtype
    )
    return h, y, quantize_output(y, quant, scale, layout)


def _rank_main(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch

    import arnorm
    from arnorm.testing._compare import ulp_distance

    device = torch.device("cuda", torch.cuda.current_device()) if opts["cuda"] else torch.device("cpu")
    dtype = getattr(torch, opts["dtype"])
    hidden, tokens, quant = opts["hidden"], opts["tokens"], opts["quant"]
    quant = None if quant == "none" else quant
    norm = arnorm.RMSNorm(eps=1e-6, weight_offset=1.0)  # Gemma-style, the harder case
    try:
        op = arnorm.AllReduceNorm(
            torch.distributed.group.WORLD,
            hidden_size=hidden,
            dtype=dtype,
            norm=norm,
            quant=quant,
            max_tokens=max(tokens, 64),
            backend=opts["backend"],
            device=device,
        )
    except arnorm.SelectionError as exc:
        # Raised identically on every rank: rank 0's message is the whole story (no traceback).
        return {"selection_error": f"{type(exc).__name__}: {exc}"}
    g = torch.Generator().manual_seed(1234)  # the same on every rank: shards are sliced, not re-drawn
    shard = hidden // world
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    residual = torch.zeros(tokens, hidden, dtype=dtype, device=device)
    rows = []
    for layer in range(opts["layers"]):
        w_full = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(dtype).to(device)
        gamma = (torch.randn(hidden, generator=g) * 0.1).to(dtype).to(device)
        # Row-parallel linear: this rank holds input columns [rank*shard, (rank+1)*shard).
        cols = slice(rank * shard, (rank + 1) * shard)
        partial = (x[:, cols].float() @ w_full[:, cols].float().t()).to(dtype)
        sample = FORMAT_SPECS[quant].sample_scale if quant else None
        scale = torch.tensor([sample], device=device) if sample is not None else None
        ref_h, ref_y, ref_q = _unfused(
            partial, residual, gamma, norm.eps, norm.weight_offset, quant, scale, op.problem.scale_layout
        )
        out = op(partial.clone(), residual, gamma, scale)
        normed, q = out.normed, out.quant
        if normed is None or (quant is not None and q is None):
            raise RuntimeError(f"backend {op.backend}: an output is missing ({out!r})")
        row = {
            "layer": layer,
            "residual_max_abs": float((out.residual.float() - ref_h.float()).abs().max()),
            "normed_max_ulps": ulp_distance(normed, ref_y),
            "normed_max_abs": float((normed.float() - ref_y.float()).abs().max()),
        }
        if q is not None:
            from arnorm.quant import dequantize

            deq, ref_deq = dequantize(q), dequantize(ref_q)
            row["quant_max_abs"] = float((deq - ref_deq).abs().max())
            row["quant_mismatch"] = float(
                (q.data.view(torch.uint8) != ref_q.data.view(torch.uint8)).float().mean()
            )
        rows.append(row)
        residual, x = out.residual.clone(), normed
    result = {"backend": op.backend, "explain": str(op.explain(tokens)), "rows": rows, "device": str(device)}
    op.close()
    return result


def check_backend_names(text: str | None) -> None:
    """A ``--backend`` name that is not registered is a usage error here, before ranks are spawned."""
    if text is None:
        return
    from arnorm._config import parse_names
    from arnorm.cli._usage import UsageError
    from arnorm.registry._capabilities import did_you_mean, join_or
    from arnorm.registry._discovery import get_registry

    known = [i.name for i in get_registry().infos()]
    names = parse_names(text)
    unknown = [n for n in names if n not in known]
    if not names:
        raise UsageError(f"--backend: {text!r} names no backend (needs {join_or(known)})")
    if unknown:
        what = "not a registered backend" if len(unknown) == 1 else "not registered backends"
        hints = "".join(did_you_mean(n, known) for n in unknown)
        raise UsageError(f"--backend: {', '.join(map(repr, unknown))} {what} (needs {join_or(known)}{hints})")


def run(args: argparse.Namespace) -> int:
    """``arnorm demo`` without ``--model``; exit status 0: every layer matched, 1: a mismatch."""
    import torch

    from arnorm.cli._usage import UsageError
    from arnorm.testing import run_ranks

    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS.items()}
    if values["hidden"] % args.tp:
        raise UsageError(f"--hidden {values['hidden']}: not a multiple of --tp {args.tp} (needs H = k * TP)")
    use_cuda = pick_device(args.device, args.tp) == "cuda"
    opts = {**values, "dtype": args.dtype, "backend": args.backend, "cuda": use_cuda}
    # NCCL needs one GPU per rank; with fewer GPUs the ranks share them over gloo (CUDA tensors).
    comm = "nccl" if use_cuda and torch.cuda.device_count() >= args.tp else "gloo"
    where = f"{args.tp} rank(s) on {'GPU' if use_cuda else 'CPU'} with {comm}"
    print(
        f"arnorm demo: {opts['layers']} layers, T={opts['tokens']}, H={opts['hidden']}, {args.dtype}, "
        f"quant={opts['quant']}, TP={args.tp} on {where}"
    )
    results = run_ranks(args.tp, _rank_main, opts, backend=comm)
    first = results[0]
    if "selection_error" in first:
        print(f"arnorm demo: {first['selection_error']}", file=sys.stderr)
        return 1
    print(first["explain"])
    print("layer  residual max|err|  normed max ulps  normed max|err|  quant max|err|  quant codes differing")
    ok = True
    # fp32 outputs: the reference rounds in fp32 at every step, so 1 ulp is not attainable (docs/numerics.md).
    limit = 8 if args.dtype == "float32" else 1
    for r in first["rows"]:
        q_abs = f"{r['quant_max_abs']:.3g}" if "quant_max_abs" in r else "-"
        q_mis = f"{100 * r['quant_mismatch']:.4f}%" if "quant_mismatch" in r else "-"
        print(
            f"{r['layer']:>5}  {r['residual_max_abs']:>17.3g}  {r['normed_max_ulps']:>15}  "
            f"{r['normed_max_abs']:>15.3g}  {q_abs:>14}  {q_mis:>21}"
        )
        ok &= r["normed_max_ulps"] <= limit
    same = all(res["backend"] == first["backend"] for res in results)
    verdict = "OK" if ok and same else "MISMATCH"
    print(
        f"backend on every rank: {first['backend']} ({'agreed' if same else 'DISAGREED'}); "
        f"normed within {limit} ulp of the unfused path: {'yes' if ok else 'NO'} -> {verdict}"
    )
    return 0 if ok and same else 1
