"""A/B of ``triton`` kernel variants through the public op, on one GPU, in one process.

Each variant is a copy of ``arnorm_triton/_kernels.py`` (a file path; ``git show
<commit>:arnorm_triton/_kernels.py > old.py`` makes one of an older commit). For each, the script
builds ``AllReduceNorm(arnorm.LOCAL, ...)`` ops with that module standing in for the kernel module
(``arnorm_triton._launch.K``), checks every output of every cell bit for bit against the first
variant's, then times the cells by CUDA-graph replay (bench_public_op's ``graph_us``) in
interleaved rounds, so drift of the lent host falls on every variant alike. On one host the
variants compare; across hosts they do not (benchmarks/results/README.md).

    python3 lab/lab_kernel_variants.py old=old.py new=arnorm_triton/_kernels.py \\
        [--cells decode,bw] [--rounds 5] [--flashinfer]

``--warps 16,32`` times every variant at each warp count instead of the launch table's (the
launcher's fixed-warp path, ``kernel[grid]``; graph replay does not see the host cost), a column
per variant and count. ``--not-in-place`` builds the ops with ``inplace=False`` (the public op's
default writes the new residual over ``hidden_states``, which costs 0.5-2 us at T 8192: run 32).
Prints one markdown table: microseconds per call (median over rounds of the
median of 9 replays of 20 calls) and, at T 8192, the fraction of copy bandwidth. ``--smoke``: CPU,
Triton interpreter, tiny shapes, no timing claims (tests/arnorm_triton/test_bench_scripts.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

#: (H, format, normed output, T) per preset.
CELLS = {
    "decode": [
        *[(8192, "fp8_static", False, t) for t in (1, 16, 128)],
        (8192, "none", True, 1),
        (8192, "none", True, 128),
        (4096, "fp8_static", False, 128),
    ],
    "bw": [
        (4096, "fp8_static", True, 8192),
        (8192, "fp8_static", True, 8192),
        (8192, "fp8_static", False, 8192),
        (8192, "mxfp8", True, 8192),
        (4096, "nvfp4", False, 8192),
        (8192, "nvfp4", True, 8192),
    ],
    "nvfp4": [(h, "nvfp4", n, t) for h in (4096, 8192) for n in (False, True) for t in (1, 128, 8192)],
    "twopass": [
        (h, f, n, t)
        for f in ("nvfp4", "mxfp8")
        for h in (4096, 8192)
        for n in (False, True)
        for t in (1024, 4096, 8192)
    ],
    "nvfp4_large": [(h, "nvfp4", n, 8192) for h in (4096, 8192) for n in (False, True)],
    "smoke": [(64, "fp8_static", False, 3), (64, "nvfp4", True, 5)],
    # Issue 43: where x, the residual and the normed output (3 T H bf16) stop fitting the 50 MiB L2
    # while FlashInfer's two in-place buffers (2 T H) still do: T H = 8M is 48 MiB against 32.
    "l2": [
        *[(8192, "none", True, t) for t in (128, 512, 1024, 2048, 8192)],
        *[(4096, "none", True, t) for t in (1024, 2048, 8192)],
        (8192, "fp8_static", False, 1024),
        (8192, "fp8_static", True, 1024),
        (4096, "fp8_static", False, 2048),
        (8192, "fp8_static", False, 8192),
    ],
    "l2w": [(8192, "none", True, 1024), (8192, "none", True, 2048), (4096, "none", True, 2048)],
}


def load_variant(name: str, path: str) -> Any:
    """Import ``path`` as a module of its own (Triton reads a kernel's source from its file)."""
    spec = importlib.util.spec_from_file_location(f"kernel_variant_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def outputs(result: Any) -> list[Any]:
    """Every tensor of an ``Output``, as bytes (clones: the next call reuses the buffers)."""
    import torch

    quant = result.quant
    tensors = [result.residual, result.normed] + ([] if quant is None else [quant.data, quant.scale])
    return [None if t is None else t.detach().clone().view(torch.uint8) for t in tensors]


def same_outputs(ref: list[Any], got: list[Any]) -> bool:
    """Whether two :func:`outputs` lists hold the same tensors bit for bit, ``None`` in the same places."""
    import torch

    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(ref, got, strict=True)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "variants", nargs="+", help="NAME=PATH of a copy of arnorm_triton/_kernels.py (first: reference)"
    )
    p.add_argument("--cells", default="decode,bw", help="comma-separated presets: " + ", ".join(CELLS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warps", default="", help="comma-separated warp counts (default: the launch table's)")
    p.add_argument("--flashinfer", action="store_true", help="FlashInfer rows for the cells it serves")
    p.add_argument("--out", action="store_true", help="also time each variant with out= (caller's buffers)")
    p.add_argument(
        "--two-pass",
        action="store_true",
        help="also time each variant's swizzled-scale cells in one and two passes",
    )
    p.add_argument(
        "--not-in-place",
        action="store_true",
        help="ops built with inplace=False (the new residual in a buffer of its own)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no claims")
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from bench_public_op import (
        COPY_BYTES,
        CpuDevice,
        CudaDevice,
        Inputs,
        bytes_moved,
        copy_bandwidth,
        fi_call,
        make_op,
    )

    import arnorm_triton._launch as launch

    modules = {}
    for spec in args.variants:
        name, _, path = spec.partition("=")
        modules[name] = load_variant(name, path)
    counts = [int(w) for w in args.warps.split(",") if w]
    # column -> (kernel module, fixed warps or None)
    variants = {f"{n}@{w}" if counts else n: (m, w) for n, m in modules.items() for w in (counts or [None])}
    cells = [c for preset in (["smoke"] if args.smoke else args.cells.split(",")) for c in CELLS[preset]]
    dev = CpuDevice() if args.smoke else CudaDevice()
    fi = None
    if args.flashinfer and not args.smoke:
        import flashinfer.norm as fi
    bw = 0.0 if args.smoke else max(copy_bandwidth(dev, COPY_BYTES).values())
    kernels = launch.K
    ops: dict[tuple[str, tuple[Any, ...]], Any] = {}
    exact: dict[tuple[str, tuple[Any, ...]], bool] = {}
    reference: dict[tuple[Any, ...], list[Any]] = {}
    inputs = {c: Inputs(dev, c[3], c[0], c[1]) for c in cells}
    t0 = time.time()
    with torch.no_grad():
        try:
            for name, (module, warps) in variants.items():
                launch.K = module  # read at each op's construction and compile
                for c in cells:
                    inp = inputs[c]
                    op = make_op(dev, c[0], c[1], c[2], max_tokens=c[3], inplace=not args.not_in_place)
                    if warps is not None:  # every launch of this op through kernel[grid] at `warps`
                        launcher = op._dispatch.table[c[3]].launcher
                        launcher.fixed_warps = warps
                        launcher.unbind()
                    x = inp.x.clone()
                    got = outputs(op(x, inp.r, inp.w, inp.scale))
                    ref = reference.setdefault(c, got)
                    exact[(name, c)] = same_outputs(ref, got)
                    ops[(name, c)] = (op, x)
                print(f"{name}: built in {time.time() - t0:.0f} s", flush=True)
        finally:
            launch.K = kernels
        times: dict[tuple[str, tuple[Any, ...]], list[float]] = {}
        for _ in range(1 if args.smoke else args.rounds):
            for c in cells:
                inp = inputs[c]
                for name in variants:
                    op, x = ops[(name, c)]
                    # The launcher reads its kernel module at every (re)bind and grid size: the
                    # variant's, for every column of this variant (the 1pass/2pass re-binds too).
                    launch.K = variants[name][0]
                    us = dev.graph_us(lambda op=op, x=x, inp=inp: op(x, inp.r, inp.w, inp.scale), 20, 9)
                    times.setdefault((name, c), []).append(us)
                    if args.two_pass and c[1] in ("nvfp4", "mxfp8"):  # the same op, both store modes
                        launcher = op._dispatch.table[c[3]].launcher
                        for two, label in ((False, " 1pass"), (True, " 2pass"), (None, "")):
                            launcher.fixed_two_pass = two
                            launcher.unbind()
                            if two is not None:  # checked on fresh inputs against the first variant's
                                got = outputs(op(inp.x.clone(), inp.r, inp.w, inp.scale))
                                exact[(name + label, c)] = same_outputs(reference[c], got)
                                us = dev.graph_us(
                                    lambda op=op, x=x, inp=inp: op(x, inp.r, inp.w, inp.scale), 20, 9
                                )
                                times.setdefault((name + label, c), []).append(us)
                    if args.out:  # the caller's buffers, reused by every call (as FlashInfer's in place)
                        o = op.empty_output(c[3], inp.scale)
                        us = dev.graph_us(
                            lambda op=op, x=x, inp=inp, o=o: op(x, inp.r, inp.w, inp.scale, out=o), 20, 9
                        )
                        times.setdefault((name + " out=", c), []).append(us)
                    launch.K = kernels
                fc = fi_call(fi, inp, c[2]) if fi is not None else None
                if fc is not None:
                    times.setdefault(("flashinfer", c), []).append(dev.graph_us(fc, 20, 9))
    names = [
        n
        for v in variants
        for n in [
            v,
            *([v + " 1pass", v + " 2pass"] if args.two_pass else []),
            *([v + " out="] if args.out else []),
        ]
    ]
    names += ["flashinfer"] if fi is not None else []
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; us per call (median over rounds); (fraction of copy bw)")
    print("| H | format | normed | T | " + " | ".join(names) + " |")
    print("|---:|---|---|---:|" + "---:|" * len(names))
    for c in cells:
        row = []
        for name in names:
            if (name, c) not in times:
                row.append("-")
                continue
            us = statistics.median(times[(name, c)])
            moved = bytes_moved(c[3], c[0], c[1], c[2])
            frac = f" ({moved / (us * 1e-6) / bw:.3f})" if bw and c[3] >= 8192 else ""
            bad = "" if exact.get((name, c), True) else " NOT EXACT"
            row.append(f"{us:.2f}{frac}{bad}")
        normed = "yes" if c[2] else "no"
        print(f"| {c[0]} | {c[1]} | {normed} | {c[3]} | " + " | ".join(row) + " |", flush=True)
    if not all(exact.values()):
        sys.exit("lab_kernel_variants: a variant's outputs differ from the first variant's (NOT EXACT rows)")


if __name__ == "__main__":
    main()
