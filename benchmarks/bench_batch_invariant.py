"""What batch-invariant mode costs: the public op at TP 1 with ``Config(batch_invariant=True)`` against
the default, per token count, on one GPU (docs/numerics.md, section 10).

At TP 1 both modes select ``triton``; batch invariance runs its exact mode, whose one difference at
TP 1 is the warp count: the default takes it from the measured launch table (``arnorm_triton/
_launch_measured.py``, a function of T), the invariant mode from the row's shape alone. So the price
is the launch table's gain, per (H, format, T). For every cell the run also checks, on the op it
timed, whether a batch's first row is bitwise the row computed alone: it must be in invariant mode,
and the default mode's column shows where the table actually changes the bits.

CUDA-graph replay of ``--calls`` back-to-back calls (median of ``--replays``, microseconds per call),
bf16, plain RMSNorm, every format, normed output on for ``none`` and off for the quantized formats
(what a quantized GEMM reads), T at the table's bucket edges. Writes ``batch-invariant-<date>-<gpu>.md``
and ``.json`` to ``--out`` (default ``$OUT`` or ``benchmarks/results``). ``--smoke``: CPU, Triton
interpreter, tiny shapes, no timing claims (a test runs it). On the GPU host, from the repository
root::

    python benchmarks/bench_batch_invariant.py
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_public_op as pub

TOKENS = [1, 2, 16, 17, 128, 129, 1024, 1025, 4096, 8192]


def make_op(dev: Any, h: int, fmt: str, invariant: bool, max_tokens: int) -> Any:
    import torch

    import arnorm

    quant, layout = pub.FORMATS[fmt]
    return arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=h, dtype=torch.bfloat16, norm=arnorm.RMSNorm(pub.EPS), quant=quant,
        scale_layout=layout, max_tokens=max_tokens, normed_output=fmt == "none", device=dev.device,
        config=arnorm.Config(batch_invariant=invariant),
    )  # fmt: skip


def first_row_alone(op: Any, inp: pub.Inputs) -> bool:
    """Whether row 0 of a call on ``inp`` is bitwise row 0 called alone (every output)."""
    import torch

    def bits(out: Any) -> list[Any]:
        parts = [out.residual[:1], out.normed[:1] if out.normed is not None else None]
        if out.quant is not None:
            parts.append(out.quant.data[:1].view(torch.uint8))
            if out.quant.format == "fp8_per_token":
                parts.append(out.quant.scale[:1])
        return [p.view(torch.uint8).cpu() for p in parts if p is not None]

    batch = bits(op(inp.x.clone(), inp.r, inp.w, inp.scale))
    alone = bits(op(inp.x[:1].clone(), inp.r[:1], inp.w, inp.scale))
    return all(torch.equal(a, b) for a, b in zip(batch, alone, strict=True))


def run(args: argparse.Namespace, dev: Any, report: dict) -> None:
    rows, errors = report["rows"], report["errors"]
    P = functools.partial
    for h in args.hidden:
        for fmt in args.formats:
            where = f"H={h} {fmt}"
            if pub.elapsed() > args.deadline:
                report["skipped"].append(f"{where} (deadline)")
                continue
            try:
                ops = {mode: make_op(dev, h, fmt, mode == "invariant", max(args.tokens))
                       for mode in ("default", "invariant")}  # fmt: skip
            except Exception as exc:
                errors[where] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"  {where} failed: {errors[where]}", flush=True)
                continue
            for t in args.tokens:
                inp = pub.Inputs(dev, t, h, fmt)
                row: dict[str, Any] = {"H": h, "format": fmt, "T": t}
                for mode, op in ops.items():
                    row[f"{mode}_backend"] = op.backend_for(t)
                    call = P(op, inp.x.clone(), inp.r, inp.w, inp.scale)
                    us = pub.record([], errors, f"{where} T={t} {mode}", P(dev.graph_us, call, args.calls,
                                                                          args.replays))  # fmt: skip
                    row[f"{mode}_us"] = None if us is None else round(us, 3)
                    row[f"{mode}_row0_alone"] = first_row_alone(op, inp)
                if row["default_us"] and row["invariant_us"]:
                    row["ratio"] = round(row["invariant_us"] / row["default_us"], 3)
                rows.append(row)
            for op in ops.values():
                op.close()
            print(f"[{pub.elapsed():6.1f}s] {where}", flush=True)


def markdown(report: dict) -> str:
    lines = [
        f"# Batch-invariant mode's cost at TP 1, {report['gpu']}, {report['date']}",
        "",
        f"torch {report['torch']}, triton {report['triton']}; CUDA-graph replay, {report['calls']} calls per "
        f"graph, median of {report['replays']} replays; bf16, plain RMSNorm; `python "
        "benchmarks/bench_batch_invariant.py`. `row 0 alone`: a batch's first row is bitwise the row "
        "called alone (every output).",
    ]
    if report["smoke"]:
        lines += ["", "**Smoke run on CPU (Triton interpreter): no timing claims.**"]
    lines += [
        "",
        "| H | format | T | default us | invariant us | invariant / default | row 0 alone (default, "
        "invariant) |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        alone = f"{r['default_row0_alone']}, {r['invariant_row0_alone']}"
        lines.append(
            f"| {r['H']} | {r['format']} | {r['T']} | {r.get('default_us') or '-'} | "
            f"{r.get('invariant_us') or '-'} | {ratio} | {alone} |"
        )
    broken = [r for r in report["rows"] if not r["invariant_row0_alone"]]
    lines += ["", f"invariant mode rows not bitwise alone: {len(broken)} (needs 0)"]
    if report["errors"]:
        lines += ["", "errors:"] + [f"- {k}: {v}" for k, v in report["errors"].items()]
    if report["skipped"]:
        lines += ["", "skipped: " + "; ".join(report["skipped"])]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing claims"
    )
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--deadline", type=float, default=500.0, help="seconds; later cells are skipped")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = p.parse_args(argv)
    args.hidden, args.formats, args.tokens = [4096, 8192], list(pub.FORMATS), TOKENS
    if args.smoke:
        args.hidden, args.formats, args.tokens = [256], ["none", "fp8_per_token"], [1, 3]
        args.calls, args.replays = 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev, head = pub.open_device(args.smoke, "bench_batch_invariant")
    import torch

    report: dict[str, Any] = {
        **head,
        "calls": args.calls,
        "replays": args.replays,
        "errors": {},
        "skipped": [],
        "rows": [],
    }
    with torch.no_grad():
        run(args, dev, report)
    report["seconds"] = pub.elapsed()
    pub.write_report(report, "batch-invariant", markdown(report), args.out)
    return 1 if any(not r["invariant_row0_alone"] for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
