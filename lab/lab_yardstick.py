"""Issue 14's line at one cell, on one GPU: the public op's time over several rounds against copy
bandwidth measured with copies of several sizes, interleaved.

Issue 14 asks for nvfp4 at >= 0.90 of copy bandwidth at T >= 8192. One cell (nvfp4, H 4096,
T 8192, no normed output, in place, swizzled scales) takes 57.6-57.9 us on every H200 seen, and
reads 0.895-0.908 because the yardstick moves between machines (4.20-4.25 TB/s). This script
puts the cell and its neighbours beside the yardstick at several copy sizes (the labs used 512
MiB until 2026-12-04, the benches 1 GiB), in ``--rounds`` interleaved rounds on one machine, so
that the question "is the cell under the line here, and against which yardstick" has one answer
per machine::

    python3 lab/lab_yardstick.py [--sizes 256,512,1024,2048] [--rounds 7]

Each round times every copy size (bench_public_op's ``copy_bandwidth``: the best of its methods,
read + write) and every cell (bench_public_op's ``graph_us``: the median of 7 replays of a graph
of 20 calls). Prints and writes ``yardstick-<date>-<gpu>.md`` / ``.json`` to ``--out``: per size
the bandwidth's median and range, per cell its time's median and range, and the fraction of
each size's median bandwidth. ``--smoke``: CPU, Triton interpreter, tiny shapes, no claims
(tests/arnorm_triton/test_bench_scripts.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_public_op as B

#: (label, H, format, normed output, inplace, scale layout or None for the format's own) at T 8192.
CELLS = [
    ("nvfp4, the missed cell", 4096, "nvfp4", False, True, None),
    ("nvfp4, not in place", 4096, "nvfp4", False, False, None),
    ("nvfp4, linear scales", 4096, "nvfp4", False, True, "linear"),
    ("nvfp4, normed", 4096, "nvfp4", True, True, None),
    ("fp8_static (control)", 4096, "fp8_static", False, True, None),
]
TARGET = 0.90


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="256,512,1024,2048", help="copy sizes in MiB, one way")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no claims")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = p.parse_args(argv)
    args.sizes = [int(s) << 20 for s in args.sizes.split(",")]
    args.hidden_scale = 1
    if args.smoke:
        args.sizes, args.rounds, args.tokens, args.hidden_scale = [1 << 14, 1 << 16], 2, 5, 16
    return args


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(args: argparse.Namespace, dev: Any) -> dict[str, Any]:
    """``rounds`` rounds of every copy size, then every cell; the raw numbers of each round."""
    calls, replays = (2, 1) if args.smoke else (20, 7)
    cells = []
    for label, h, fmt, normed, inplace, layout in CELLS:
        h //= args.hidden_scale
        op = B.make_op(dev, h, fmt, normed, args.tokens, inplace=inplace, layout=layout)
        inp = B.Inputs(dev, args.tokens, h, fmt)
        status = B.check_op(op, inp)
        layout_used = layout or B.FORMATS[fmt][1]
        # The swizzled layout's bytes: the same as the linear one's when T is a multiple of 128.
        moved = B.bytes_moved(args.tokens, h, fmt, normed)
        x = inp.x.clone()

        def call(op: Any = op, x: Any = x, inp: Any = inp) -> Any:
            return op(x, inp.r, inp.w, inp.scale)

        cells.append({"label": label, "h": h, "format": fmt, "normed": normed, "inplace": inplace,
                      "layout": layout_used, "check": status, "bytes": moved, "op": op, "call": call,
                      "us": []})  # fmt: skip
    copies: dict[int, list[dict[str, float]]] = {size: [] for size in args.sizes}
    for r in range(args.rounds):
        for size in args.sizes:
            copies[size].append(B.copy_bandwidth(dev, size))
        for cell in cells:
            cell["us"].append(dev.graph_us(cell["call"], calls, replays))
        print(f"[{B.elapsed():6.1f}s] round {r + 1}: "
              + ", ".join(f"{c['us'][-1]:.2f}" for c in cells), flush=True)  # fmt: skip
    for cell in cells:
        cell["op"].close()
        del cell["op"], cell["call"]
    return {"copies": {str(s): v for s, v in copies.items()}, "cells": cells}


def summarize(report: dict[str, Any]) -> None:
    """Medians and ranges; each cell's fraction of each size's median best bandwidth."""
    bws = {}
    for size, rounds in report["copies"].items():
        best = [max(r.values(), default=0.0) for r in rounds]
        winners = sorted({max(r, key=r.__getitem__) for r in rounds if r})
        report.setdefault("bandwidth", {})[size] = {**spread(best), "methods": winners}
        bws[size] = statistics.median(best)
    for cell in report["cells"]:
        cell["us_spread"] = spread(cell["us"])
        med = cell["us_spread"]["median"] * 1e-6
        cell["fraction"] = {size: (cell["bytes"] / med / bw if bw else 0.0) for size, bw in bws.items()}


def markdown(report: dict[str, Any]) -> str:
    sizes = list(report["copies"])
    mib = [f"{int(s) >> 20} MiB" if int(s) >= 1 << 20 else f"{int(s)} B" for s in sizes]
    lines = [
        f"# Issue 14's line at T {report['tokens']}: the cell against the yardstick's size ({report['gpu']}, "
        f"{report['date']})",
        "",
        f"torch {report['torch']}, triton {report['triton']}. {report['rounds']} interleaved rounds."
        + (" Smoke run on CPU: tiny shapes, no claims." if report["smoke"] else ""),
        "",
        "| copy size | best copy bandwidth, median (range) | method |",
        "|---:|---|---|",
    ]
    for size, label in zip(sizes, mib, strict=True):
        b = report["bandwidth"][size]
        tb = {k: b[k] / 1e12 for k in ("median", "min", "max")}
        lines.append(f"| {label} | {tb['median']:.3f} TB/s ({tb['min']:.3f}-{tb['max']:.3f}) "
                     f"| {', '.join(b['methods'])} |")  # fmt: skip
    lines += ["", "| cell | H | check | us per call, median (range) | " + " | ".join(
        f"fraction at {m}" for m in mib) + " |", "|---|---:|---|---|" + "---:|" * len(sizes)]  # fmt: skip
    for c in report["cells"]:
        s = c["us_spread"]
        fr = [c["fraction"][size] for size in sizes]
        frac = " | ".join(f"{f:.3f} {'met' if f >= TARGET else 'MISSED'}" for f in fr)
        lines.append(f"| {c['label']} | {c['h']} | {c['check']} "
                     f"| {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {frac} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton's kernels
    import torch
    import triton

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("lab_yardstick: needs a CUDA GPU (or --smoke)")
    dev: Any = B.CpuDevice() if args.smoke else B.CudaDevice()
    with torch.no_grad():
        report = {
            "date": datetime.date.today().isoformat(),
            "gpu": "CPU (smoke)" if args.smoke else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke,
            "tokens": args.tokens, "rounds": args.rounds, **measure(args, dev),
        }  # fmt: skip
    summarize(report)
    B.write_report(report, "yardstick", markdown(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
