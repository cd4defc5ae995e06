"""The fused Triton kernel alone at TP 1: measure warps per (H, T, format, outputs) and write the
launch table (``arnorm_triton/_launch_measured.py``) the ``triton`` backend launches with.

For every H in ``--hidden``, format, normed output on/off and T in 1, 16, 128, 1024, 8192, the
kernel is timed with each warp count that gives 8 to 64 elements per thread (CUDA-graph replay of
``--calls`` back-to-back launches of ``arnorm_triton._launch.FusedLauncher``, in place as the op
runs, with programmatic dependent launch where the backend would use it; median of
``--replays``). A bucket keeps the default warp count unless another is more than 2 % faster, so
noise does not move the table. Every candidate is compiled first in parallel worker processes
(Triton's disk cache then serves the timing process). Outputs, under ``--out``:
``launch-table-<date>.md`` (every timing, the choice per bucket) and ``_launch_measured.py``;
``--write-table`` also replaces ``arnorm_triton/_launch_measured.py`` in this tree, which is then
committed (docs/performance.md, "The launch table"). The public op is benchmarked by
``bench_public_op.py``, whose device helpers this script shares (it runs from ``benchmarks/``,
beside it).

    python benchmarks/tune_launch_table.py --write-table      # on the GPU host, repository root
    python benchmarks/tune_launch_table.py --smoke --out /tmp/x  # CPU, interpreter, no claims
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import multiprocessing
import os
import pathlib
import sys
import time
from typing import Any

# Run as a script, this file's folder (benchmarks/) is first on sys.path.
from bench_public_op import COPY_BYTES, FORMATS, CpuDevice, CudaDevice, bytes_moved, copy_bandwidth

START = time.monotonic()
EPS = 1e-6
TOKENS = (1, 16, 128, 1024, 8192)
#: The table bucket each measured T stands for (``t_max``; the last one serves every larger T).
BUCKET = {1: 1, 16: 16, 128: 128, 1024: 1024, 8192: 1 << 30}
REPO = pathlib.Path(__file__).resolve().parent.parent


def elapsed() -> float:
    return time.monotonic() - START


def candidates(block: int) -> list[int]:
    """Warp counts giving 8 to 64 elements per thread (the default always among them)."""
    from arnorm_triton._launch_table import default_num_warps

    warps = [w for w in (1, 2, 4, 8, 16, 32) if 8 <= block // (32 * w) <= 64]
    return sorted(set(warps) | {default_num_warps(block)})


def variants(formats: list[str]) -> list[tuple[str, bool]]:
    return [(f, n) for f in formats for n in (True, False) if not (f == "none" and not n)]


class KernelRun:
    """One (T, H, format, outputs, warps) launch on static buffers, in place like the op."""

    def __init__(self, device: Any, t: int, h: int, fmt: str, normed: bool, warps: int) -> None:
        import torch

        from arnorm.plugin import FORMAT_SPECS, RMSNorm
        from arnorm_triton._kernels import INTERPRETED
        from arnorm_triton._launch import FusedLauncher, LaunchConfig
        from arnorm_triton._outputs import OutputPlan

        cuda = device.type == "cuda"
        arch = tuple(torch.cuda.get_device_capability(device)) if cuda else None
        quant, layout = FORMATS[fmt]
        pdl = False
        if cuda and arch >= (9, 0) and not torch.version.hip:
            import triton.language as tl

            pdl = hasattr(tl.extra.cuda, "gdc_wait")
        self.launcher = FusedLauncher(
            hidden=h, itemsize=2, quant=quant, layout=layout, write_normed=normed, num_partials=1,
            norm=RMSNorm(EPS), soft=INTERPRETED, soft_fp8=INTERPRETED or not cuda or arch < (8, 9), pdl=pdl,
            arch=arch, num_warps=warps,
        )  # fmt: skip
        g = torch.Generator(device=device).manual_seed(t + h)
        bf16 = torch.bfloat16
        self.t, self.h = t, h
        self.x = torch.randn((t, h), generator=g, device=device).to(bf16)
        self.r = torch.randn((t, h), generator=g, device=device).to(bf16)
        self.w = (torch.randn((h,), generator=g, device=device) * 0.1 + 1.0).to(bf16)
        sample = FORMAT_SPECS[quant].sample_scale if quant is not None else None
        self.scale = torch.tensor([sample], device=device) if sample is not None else None
        # The op's own outputs, shaped and typed by the format table.
        plan = OutputPlan(hidden=h, dtype=bf16, quant=quant, layout=layout, normed=normed, device=device)
        self.y, self.q, self.sf = plan.alloc(t)
        h_sep = torch.empty_like(self.x)  # binding validates with x and h apart
        tensors = (self.x, self.r, self.w, self.scale, h_sep, self.y, self.q, self.sf)
        outputs = [o for o in (h_sep, self.y, self.q, self.sf) if o is not None]
        self.launcher.bind(tensors, outputs, t, (h, h, h), [LaunchConfig(warps)])

    def __call__(self) -> None:
        h = self.h
        self.launcher.launch(
            self.x, self.r, self.w, self.scale, self.x, self.y, self.q, self.sf, self.t, h, h, h
        )


def _precompile(spec: tuple[int, str, bool, int], smoke: bool) -> str:
    """Worker: build (compile and bind) one candidate on 3 rows; Triton's disk cache keeps it."""
    import torch

    h, fmt, normed, warps = spec
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    try:
        KernelRun(device, 3, h, fmt, normed, warps)
        return ""
    except Exception as exc:
        return f"{spec}: {type(exc).__name__}: {str(exc)[:200]}"


def precompile(args: argparse.Namespace, specs: list[tuple[int, str, bool, int]]) -> list[str]:
    """Compile every candidate in ``--jobs`` spawned processes (compilation is CPU-bound)."""
    if args.jobs <= 1:
        return [e for e in (_precompile(s, args.smoke) for s in specs) if e]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        return [e for e in pool.map(_precompile, specs, [args.smoke] * len(specs)) if e]


def tune(args: argparse.Namespace, dev: Any, bw: float) -> tuple[dict, list[dict], list[str]]:
    """Time every candidate; return (table, timing rows, errors)."""
    from arnorm_triton._kernels import QUANT_CODES, row_shape
    from arnorm_triton._launch_table import default_num_warps

    table: dict[tuple[int, int, int, bool, int], tuple[tuple[int, int], ...]] = {}
    rows: list[dict] = []
    errors: list[str] = []
    major = 0 if args.smoke else dev.torch.cuda.get_device_capability()[0]
    for h in args.hidden:
        for fmt, normed in variants(args.formats):
            quant = FORMATS[fmt][0]
            block = row_shape(h, quant, 2)[0]
            default = default_num_warps(block)
            picks: list[tuple[int, int]] = []
            for t in args.tokens:
                if elapsed() > args.deadline:
                    errors.append(f"H={h} {fmt} normed={normed} T={t}: skipped (deadline)")
                    continue
                times: dict[int, float] = {}
                for warps in candidates(block):
                    try:
                        run = KernelRun(dev.device, t, h, fmt, normed, warps)
                        times[warps] = dev.graph_us(run, args.calls, args.replays)
                    except Exception as exc:
                        errors.append(
                            f"H={h} {fmt} normed={normed} T={t} warps={warps}: {type(exc).__name__}: {exc}"
                        )
                if not times:
                    continue
                best = min(times, key=times.__getitem__)
                pick = default if default in times and times[default] <= 1.02 * times[best] else best
                picks.append((BUCKET.get(t, t), pick))
                for warps, us in times.items():
                    pct = 100.0 * bytes_moved(t, h, fmt, normed) / (us * 1e-6) / bw if bw else 0.0
                    row = {
                        "H": h,
                        "format": fmt,
                        "normed": normed,
                        "T": t,
                        "warps": warps,
                        "us": round(us, 2),
                    }
                    row |= {"pct_bw": round(pct, 1), "default": warps == default, "chosen": warps == pick}
                    rows.append(row)
            print(f"[{elapsed():6.1f}s] H={h} {fmt} normed={normed}: {picks}", flush=True)
            merged: list[tuple[int, int]] = []
            for t_max, warps in picks:  # a run of equal choices is one bucket (its largest t_max)
                if merged and merged[-1][1] == warps:
                    merged[-1] = (t_max, warps)
                else:
                    merged.append((t_max, warps))
            if any(w != default for _, w in merged):
                table[(major, block, QUANT_CODES[quant], normed, 2)] = tuple(merged)
    return table, rows, errors


def table_module(table: dict, header: str) -> str:
    return (
        '"""Measured launch table rows (see :mod:`arnorm_triton._launch_table`); generated, do not edit.\n\n'
        f"{header}\nRegenerate on the GPU with ``python benchmarks/tune_launch_table.py --write-table``\n"
        '(docs/performance.md, "The launch table"), then commit this file.\n"""\n\n'
        "#: (cuda major, BLOCK, QUANT code, WRITE_NORMED, itemsize) -> ((t_max, num_warps), ...); the QUANT\n"
        "#: code is the format's FormatSpec.code (fixed for good, arnorm/_formats.py).\n"
        "MEASURED: dict[tuple[int, int, int, bool, int], tuple[tuple[int, int], ...]] = {\n"
        + "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(table.items()))
        + "}\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing claims"
    )
    p.add_argument("--calls", type=int, default=20, help="launches per CUDA graph")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--deadline", type=float, default=100.0, help="seconds; later buckets are skipped")
    p.add_argument("--write-table", action="store_true", help="replace arnorm_triton/_launch_measured.py")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = p.parse_args(argv)
    args.hidden, args.formats, args.tokens = [4096, 8192], list(FORMATS), list(TOKENS)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.hidden, args.tokens, args.calls, args.replays, args.jobs = [256], [1, 3], 2, 1, min(args.jobs, 2)
    import torch
    import triton

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("tune_launch_table: needs a CUDA GPU (or --smoke)")
    dev: Any = CpuDevice() if args.smoke else CudaDevice()
    bw = max(copy_bandwidth(dev, 1 << 16 if args.smoke else COPY_BYTES).values(), default=0.0)
    specs = []
    for h in args.hidden:
        for fmt, normed in variants(args.formats):
            from arnorm_triton._kernels import row_shape

            specs += [(h, fmt, normed, w) for w in candidates(row_shape(h, FORMATS[fmt][0], 2)[0])]
    compile_errors = precompile(args, specs)
    print(f"[{elapsed():6.1f}s] compiled {len(specs)} candidates, {len(compile_errors)} failed", flush=True)
    with torch.no_grad():
        table, rows, errors = tune(args, dev, bw)
    date = datetime.date.today().isoformat()
    gpu = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name()
    header = f"Measured on {gpu}, {date}, torch {torch.__version__}, triton {triton.__version__}."
    module = table_module(table, header)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "_launch_measured.py").write_text(module)
    if args.write_table:
        (REPO / "arnorm_triton" / "_launch_measured.py").write_text(module)
    lines = [
        f"# Launch table sweep, {gpu} ({date})",
        "",
        header + f" Copy bandwidth {bw / 1e12:.2f} TB/s.",
        "",
    ]
    if args.smoke:
        lines += ["**Smoke run on CPU: no timing claims.**", ""]
    lines += [f"Error: {e}" for e in compile_errors + errors]
    lines += [
        "",
        "| H | format | normed | T | warps | us | % copy bw | |",
        "|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        mark = ("chosen" if r["chosen"] else "") + (" (default)" if r["default"] else "")
        normed = "yes" if r["normed"] else "no"
        cells = (r["H"], r["format"], normed, r["T"], r["warps"], r["us"], r["pct_bw"], mark)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "Table written:", "", "```python", module, "```", f"Run time {elapsed():.0f} s."]
    (out / f"launch-table-{date}.md").write_text("\n".join(lines) + "\n")
    print(module)
    print(
        f"wrote {out}/launch-table-{date}.md and _launch_measured.py"
        + (" (and the tree's)" if args.write_table else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
