"""The per-token-group fp8 formats and mxfp4 on one GPU: the public op held to its contract against
``reference``, and its rows batch-invariant.

1. **Exact**: ``arnorm.AllReduceNorm`` at TP 1 (``arnorm.LOCAL``), auto selection (``triton`` on a
   CUDA GPU) against ``backend="reference"`` on the same inputs, bf16, Gemma norm: the residual bit
   for bit, the normed output within 1 ulp (docs/numerics.md: reduction trees and ``rsqrt`` differ
   between kernels), codes and scales bit for bit ``arnorm.quant`` of the kernel's own normed output
   (a normed value 1 ulp off moves its group's codes and scale with it: counted, not failed), for T
   in ``--tokens`` x H in ``--hidden`` for the main variant of each format, and every other scale
   layout at H 4096 and a few T. Zero groups and NaN / inf
   columns ride along in every case (a NaN and an infinite norm weight).
2. **Batch-invariant rows**: an op built with ``Config(batch_invariant=True)``; a pool of rows sent
   as batches of 1, 7, 128 and 1024 at shifting offsets; every row's residual, normed output, codes
   and scales must be bitwise its value in the first batch that held it.

Prints one line per case and writes ``gpu-formats-<date>-<gpu>.json`` to ``--out`` (``$OUT`` by
default). Exit status 1 if anything differs. ``--smoke``: CPU, the Triton interpreter, tiny shapes
(a test runs it so the script cannot rot)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time
from typing import Any

MAIN = [
    ("fp8_per_group", "linear"),
    ("fp8_per_group_64", "linear"),
    ("fp8_per_group_ue8m0", "packed_ue8m0"),
    ("mxfp4", "linear"),
]


def _bits(t: Any) -> Any:
    import torch

    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _inputs(t: int, h: int, dev: Any, seed: int) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    x = (torch.randn(t, h, generator=g, device=dev) * 2).bfloat16()
    r = torch.randn(t, h, generator=g, device=dev).bfloat16()
    w = (torch.randn(h, generator=g, device=dev) * 0.2).bfloat16()
    x[0, :128], r[0, :128] = 0, 0  # a zero group
    w[3], w[70] = float("nan"), float("inf")
    return x, r, w


def _op(fmt: str, layout: str, h: int, dev: Any, max_tokens: int, **kw: Any) -> Any:
    import torch

    import arnorm

    return arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=h, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6, weight_offset=1.0),
        quant=fmt, scale_layout=layout, max_tokens=max_tokens, device=dev, **kw,
    )  # fmt: skip


def _differences(a: Any, b: Any, fmt: str, layout: str) -> list[str]:
    """What breaks the contract (docs/numerics.md): the residual bitwise the reference's; the normed
    output within 1 ulp of it (reduction trees and ``rsqrt`` differ between kernels); codes and scales
    bitwise ``arnorm.quant`` applied to the kernel's own normed output. Normed values off by one ulp
    are counted, with the codes and scales that differ from the reference's because of them."""
    import torch

    from arnorm import quant
    from arnorm.testing import ulps

    out = []
    if not torch.equal(_bits(a.residual), _bits(b.residual)):
        out.append(f"residual: {int((_bits(a.residual) != _bits(b.residual)).sum())} differ")
    off = ulps(a.normed, b.normed)  # two NaNs are 0 apart: a NaN's sign and payload are no contract
    if int(off.max()) > 1:
        worst = int(off.max())
        out.append(f"normed: {int((off > 1).sum())} more than 1 ulp from the reference (max {worst})")
    own = quant.quantize(b.normed, fmt, layout=layout)
    for name, x, y in [("codes", own.data, b.quant.data), ("scales", own.scale, b.quant.scale)]:
        differ = _bits(x) != _bits(y)
        if x.is_floating_point():
            differ &= ~(torch.isnan(x) & torch.isnan(y))
        if differ.any():
            out.append(f"{name}: {int(differ.sum())} differ from arnorm.quant of the kernel's normed output")
    return out


def _one_ulp(a: Any, b: Any) -> str:
    """The normed values 1 ulp from the reference, and the codes / scales that differ from the
    reference's through them (within the contract)."""
    from arnorm.testing import ulps

    n = int((ulps(a.normed, b.normed) != 0).sum())
    if not n:
        return ""
    codes = int((_bits(a.quant.data) != _bits(b.quant.data)).sum())
    scales = int((_bits(a.quant.scale) != _bits(b.quant.scale)).sum())
    return f" ({n} normed 1 ulp off the reference; through them {codes} codes, {scales} scales)"


def exact(tokens: list[int], hidden: list[int], dev: Any, all_layouts_at: list[int]) -> list[dict[str, Any]]:
    from arnorm import quant

    cases = [(f, lay, t, h) for f, lay in MAIN for h in hidden for t in tokens]
    others = [
        (f, lay)
        for f in {f for f, _ in MAIN}
        for lay in quant.FORMAT_SPECS[f].layouts
        if (f, lay) not in MAIN
    ]
    cases += [
        (f, lay, t, 4096 if 4096 in hidden else hidden[0])
        for f, lay in sorted(others)
        for t in all_layouts_at
    ]
    results = []
    ops: dict[tuple[str, str, int, str], Any] = {}
    max_t = max(tokens + all_layouts_at)
    for fmt, layout, t, h in cases:
        t0 = time.monotonic()
        got = {}
        x, r, w = _inputs(t, h, dev, t + h)
        for backend in ("reference", None):
            key = (fmt, layout, h, str(backend))
            if key not in ops:
                ops[key] = _op(fmt, layout, h, dev, max_t, **({"backend": backend} if backend else {}))
            got[backend] = ops[key](x.clone(), r, w)
        diffs = _differences(got["reference"], got[None], fmt, layout)
        note = _one_ulp(got["reference"], got[None])
        row = {"format": fmt, "layout": layout, "T": t, "H": h, "exact": not diffs, "diffs": diffs,
               "one_ulp": note.strip(" ()"), "s": round(time.monotonic() - t0, 2)}  # fmt: skip
        verdict = ("OK" + note) if not diffs else "DIFF " + "; ".join(diffs)
        print(f"exact  {fmt:24s} {layout:17s} T={t:6d} H={h:5d}  {verdict}", flush=True)
        results.append(row)
    for op in ops.values():
        op.close()
    return results


def invariance(hidden: int, sizes: list[int], dev: Any) -> list[dict[str, Any]]:
    import torch

    import arnorm
    from arnorm import quant

    pool_rows = sum(sizes) + max(sizes)
    results = []
    for fmt, layout in MAIN:
        op = _op(fmt, layout, hidden, dev, max(sizes), config=arnorm.Config(batch_invariant=True))
        x, r, w = _inputs(pool_rows, hidden, dev, 11)
        first: dict[int, dict[str, Any]] = {}
        bad = 0
        start = 0
        for size in sizes * 2:
            start = (start + 5) % (pool_rows - size)
            out = op(x[start : start + size].clone(), r[start : start + size].clone(), w)
            # Each row decoded (codes times its scales) through the public codec: with the codes,
            # equal decoded rows mean equal scales wherever a group has a non-zero code; a linear
            # layout's scales are rows too, and are compared themselves.
            decoded = quant.dequantize(out.quant)
            for i in range(size):
                row = {"residual": out.residual[i], "normed": out.normed[i], "codes": out.quant.data[i],
                       "decoded": decoded[i]}  # fmt: skip
                if layout == "linear":
                    row["scales"] = out.quant.scale[i]
                seen = first.setdefault(start + i, {n: _bits(v).clone() for n, v in row.items()})
                bad += sum(not torch.equal(seen[n], _bits(v)) for n, v in row.items())
        op.close()
        print(f"rows   {fmt:24s} {layout:17s} H={hidden} batches {sizes}: "
              f"{'batch-invariant' if not bad else f'{bad} row outputs differ'}", flush=True)  # fmt: skip
        results.append({"format": fmt, "layout": layout, "H": hidden, "sizes": sizes, "differences": bad})
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,7,128,1024,8192,32768")
    p.add_argument("--hidden", default="2048,4096,8192")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--smoke", action="store_true", help="CPU, the interpreter, tiny shapes")
    a = p.parse_args()
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    tokens = [1, 3] if a.smoke else [int(v) for v in a.tokens.split(",")]
    hidden = [256] if a.smoke else [int(v) for v in a.hidden.split(",")]
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(
        f"# gpu_formats {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} on {gpu}",
        flush=True,
    )
    report = {
        "gpu": gpu,
        "exact": exact(tokens, hidden, dev, [1, 5] if a.smoke else [1, 1024]),
        "invariance": invariance(
            hidden[0] if a.smoke else 4096, [1, 3] if a.smoke else [1, 7, 128, 1024], dev
        ),
    }
    ok = all(r["exact"] for r in report["exact"]) and not any(r["differences"] for r in report["invariance"])
    print(f"# {'ALL EXACT AND BATCH-INVARIANT' if ok else 'DIFFERENCES FOUND'}", flush=True)
    if not a.smoke:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"gpu-formats-{datetime.date.today()}-{gpu.replace(' ', '-')}.json"
        (out / name).write_text(json.dumps(report, indent=1))
        print(f"# wrote {out / name}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
