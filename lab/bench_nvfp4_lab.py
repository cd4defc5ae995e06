"""The nvfp4 lab on one GPU (run by ``lab/gpu_nvfp4_round.sh``): exactness of every lab
variant against the production kernel, then CUDA-graph timings as fractions of copy bandwidth.

1. Compiles every (kernel, H, normed, layout, warps) in parallel worker processes first (they fill
   Triton's on-disk cache; the timing process then only loads).
2. Exactness on random rows with zeros, huge values, NaN and inf, H in {4096, 8192, 2000, 80}
   (2000 and 80 are not multiples of 128), global scales {realistic, 1e36, inf, 0}: residual bitwise;
   normed within 1 ulp of the production kernel's (which took the whole-block layout of ``own_f``
   on 2026-12-03, so either family may associate the fp32 sum of squares differently), and codes
   and scales bitwise equal to ``arnorm.quant`` of the variant's own normed output and to the
   production kernel's wherever their normed outputs agree.
3. Copy bandwidth (best of torch.mul(out=) and a Triton copy, as benchmarks/bench_public_op.py) and
   CUDA-graph replay of 20 calls (median of replays) for T in {8192, 16384}, H in {4096, 8192},
   normed yes/no, swizzled scales (and linear at T = 8192, H = 4096, no normed).

Writes ``nvfp4-lab.json`` and ``nvfp4-lab.md`` to ``--out``. ``--smoke``: CPU interpreter, tiny
shapes, no timing claims.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
START = time.monotonic()
EPS = 1e-6
GEMMA = 1.0  # weight offset: the Gemma norm
#: Warps per variant kind and H (production: the launch table's choice for the T, plus these).
WARPS = {4096: (4, 8), 8192: (8, 16)}
#: Lab variants timed and checked on the GPU (the intermediate steps are checked in the interpreter
#: by tests/arnorm_triton/test_nvfp4_lab.py; compiling them here would cost the round's time).
TIMED = ("fma_hw_pack", "same_f", "same_f_r2", "own_f", "own_f_r2", "own_f_r4")


def _load(name: str) -> Any:
    # bench_public_op is a maintained benchmark; the lab modules live beside this file.
    folder = HERE.parent / "benchmarks" if name == "bench_public_op" else HERE
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def elapsed() -> float:
    return time.monotonic() - START


def prod_warps(h: int, normed: bool, t: int) -> int:
    """The production launch table's warps for this call on SM 9.x."""
    from arnorm_triton._kernels import row_shape
    from arnorm_triton._launch_table import launch_config

    return launch_config((9, 0), row_shape(h, "nvfp4", 2)[0], 3, normed, 2, t)


def kernels_for(h: int, normed: bool, t: int, lab: Any) -> list[tuple[str, int]]:
    """``(kernel name, warps)`` to time: production at its table warps and the alternatives,
    every lab variant at each of ``WARPS[h]``."""
    pw = prod_warps(h, normed, t)
    out = [("production", pw)] + [("production", w) for w in WARPS.get(h, (4,)) if w != pw]
    out += [(v, w) for v in TIMED for w in WARPS.get(h, (4,))]
    return out


# -- buffers and launches -------------------------------------------------------------------------


class Bufs:
    """Inputs and outputs of one (T, H, normed, swizzled) problem."""

    def __init__(self, torch: Any, dev: Any, t: int, h: int, normed: bool, swizzled: bool, seed: int = 0,
                 special: bool = False) -> None:  # fmt: skip
        g = torch.Generator(device=dev).manual_seed(seed * 7919 + t * 31 + h)
        self.x = torch.randn((t, h), generator=g, device=dev).to(torch.bfloat16)
        self.r = torch.randn((t, h), generator=g, device=dev).to(torch.bfloat16)
        self.w = (torch.randn((h,), generator=g, device=dev) * 0.1 + 1.0).to(torch.bfloat16)
        if special and t >= 8:
            self.x[1] = 0
            self.r[1] = 0  # a zero row
            self.x[2, : h // 3] *= 1.0e30  # huge beside ordinary
            self.x[3, 7] = float("nan")
            self.x[4, h - 1] = float("inf")
            self.x[5] *= 1.0e-30  # tiny row (ordinary after the norm)
            self.w[h // 2 : h // 2 + 16] = 0  # a zero weight block
        self.h = torch.empty_like(self.x)
        self.y = torch.empty_like(self.x) if normed else None
        self.q = torch.empty((t, h // 2), dtype=torch.uint8, device=dev)
        k = h // 16
        shape = ((t + 127) // 128 * 128, (k + 3) // 4 * 4) if swizzled else (t, k)
        self.sf = torch.empty(shape, dtype=torch.uint8, device=dev)
        self.swizzled = swizzled
        self.scale = torch.tensor([448.0 * 6.0 / 8.0], device=dev)

    def fill(self) -> None:
        for t in (self.h, self.y, self.q, self.sf):
            if t is not None:
                t.fill_(0xAB if t.dtype.is_floating_point is False else 1.5)

    def nbytes(self) -> int:
        t, h = self.x.shape
        return (
            3 * t * h * 2
            + h * 2
            + (t * h * 2 if self.y is not None else 0)
            + t * h // 2
            + self.sf.numel()
            + 4
        )


def launcher(name: str, warps: int, lab: Any, b: Bufs, soft: bool) -> Any:
    kw = dict(eps=EPS, weight_offset=GEMMA, swizzled=b.swizzled, num_warps=warps, soft=soft, soft_fp8=soft)
    args = (b.x, b.r, b.w, b.scale, b.h, b.y, b.q, b.sf)
    if name == "production":
        return lambda: lab.launch_production(*args, **kw)
    return lambda: lab.launch_lab(name, *args, **kw)


# -- compile warm-up (worker processes) -------------------------------------------------------------


def _warm(jobs: list[tuple[str, int, int, bool, bool]]) -> list[str]:
    """Compile (by one launch at T = 1... 2) each job; returns error lines."""
    import torch

    lab = _load("nvfp4_lab")
    errs = []
    for name, warps, h, normed, swz in jobs:
        try:
            b = Bufs(torch, "cuda", 2, h, normed, swz)
            launcher(name, warps, lab, b, False)()
            torch.cuda.synchronize()
        except Exception as exc:  # reported, the timing process retries and records it
            errs.append(
                f"{name} w{warps} H{h} normed={normed} swz={swz}: {type(exc).__name__}: {str(exc)[:300]}"
            )
    return errs


def warm_all(jobs: list, workers: int) -> list[str]:
    chunks = [jobs[i::workers] for i in range(workers)]
    ctx = __import__("multiprocessing").get_context("spawn")
    errs: list[str] = []
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        for res in ex.map(_warm, [c for c in chunks if c]):
            errs += res
    return errs


# -- exactness ----------------------------------------------------------------------------------------


def _same(torch: Any, a: Any, b: Any) -> bool:
    return (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_variant(torch: Any, lab: Any, dev: Any, name: str, warps: int, h: int, swz: bool, soft: bool,
                  t: int) -> str:  # fmt: skip
    """'ok', or what differs, for one variant on one (H, layout) over several global scales."""
    from arnorm.quant import quantize

    notes = []
    for seed, gs in enumerate((None, 1.0e36, float("inf"), 0.0)):
        ref = Bufs(torch, dev, t, h, True, swz, seed=seed, special=True)
        got = Bufs(torch, dev, t, h, True, swz, seed=seed, special=True)
        if gs is None:  # realistic: 448 * 6 / amax of the normed output (measured on the reference)
            gs = 336.0
        ref.scale.fill_(gs)
        got.scale.fill_(gs)
        ref.fill()
        got.fill()
        launcher("production", warps, lab, ref, soft)()
        launcher(name, warps, lab, got, soft)()
        if not _same(torch, got.h, ref.h):
            return f"FAIL residual (scale {gs})"
        ya, yb = got.y.view(torch.int16).int(), ref.y.view(torch.int16).int()
        ya, yb = torch.where(ya < 0, -(ya & 0x7FFF), ya), torch.where(yb < 0, -(yb & 0x7FFF), yb)
        finite = torch.isfinite(ref.y.float())
        if finite.any() and int((ya - yb)[finite].abs().max()) > 1:
            return f"FAIL normed > 1 ulp (scale {gs})"
        rows_same = (got.y.view(torch.int16) == ref.y.view(torch.int16)).all(dim=1)
        if not torch.equal(got.q[rows_same], ref.q[rows_same]):
            return f"FAIL codes on rows with equal normed (scale {gs})"
        if gs == 336.0:
            qa = quantize(got.y, "nvfp4", scale=got.scale, layout="swizzled_128x4" if swz else "linear")
            if not torch.equal(got.q, qa.data) or not torch.equal(got.sf, qa.scale.view(torch.uint8)):
                return "FAIL quantized vs arnorm.quant of own normed"
        notes.append(int((~rows_same).sum()))
    return f"ok ({sum(notes)} rows with a 1-ulp normed difference)"


# -- timing ----------------------------------------------------------------------------------------------


def graph_us(torch: Any, fn: Any, calls: int = 20, replays: int = 15) -> float:
    """Median microseconds per call over ``replays`` replays of a CUDA graph of ``calls`` calls."""
    cuda = torch.cuda
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        for _ in range(2):
            fn()
    cuda.current_stream().wait_stream(side)
    cuda.synchronize()
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    cuda.synchronize()
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds; later steps are skipped")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--profile", metavar="KERNEL:WARPS", help="only launch this kernel 6 times (for ncu)")
    ap.add_argument("--best", action="store_true", help="print the best lab KERNEL:WARPS of --out's json")
    args = ap.parse_args()
    if args.best:
        print(best_lab(pathlib.Path(args.out) / "nvfp4-lab.json"))
        return 0
    if args.profile:
        import torch

        lab = _load("nvfp4_lab")
        name, warps = args.profile.split(":")
        b = Bufs(torch, "cuda", 8192, 4096, False, True)
        fn = launcher(name, int(warps), lab, b, False)
        for _ in range(6):
            fn()
        torch.cuda.synchronize()
        return 0
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    lab = _load("nvfp4_lab")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"checks": {}, "timings": [], "errors": [], "skipped": [], "copy_bw": 1.0}

    def save() -> None:  # after every step: a timeout still leaves what was measured
        (out / "nvfp4-lab.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "nvfp4-lab.md").write_text(render(report))

    soft = args.smoke
    dev = "cpu" if args.smoke else "cuda"
    shapes = [(8192, 4096), (16384, 4096), (8192, 8192), (16384, 8192)] if not args.smoke else [(8, 64)]
    check_h = (4096, 8192, 2000, 80) if not args.smoke else (80,)
    if not args.smoke:
        report["device"] = torch.cuda.get_device_name()
        report["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}

    # 1. Compile everything in parallel (fills Triton's cache).
    if not args.smoke:
        jobs = set()
        for t, h in shapes:
            for normed in (True, False):
                for name, w in kernels_for(h, normed, t, lab):
                    jobs.add((name, w, h, normed, True))
        jobs |= {(name, w, 4096, False, False) for name, w in kernels_for(4096, False, 8192, lab)}
        jobs |= {(name, w, h, True, s) for h in check_h for s in (True, False) for name in TIMED
                 for w in (WARPS.get(h, (4,))[0],)}  # fmt: skip
        jobs |= {
            ("production", w, h, True, s)
            for h in check_h
            for s in (True, False)
            for w in (WARPS.get(h, (4,))[0],)
        }
        t0 = elapsed()
        report["errors"] += warm_all(sorted(jobs), args.workers)
        print(f"compiled {len(jobs)} kernels in {elapsed() - t0:.0f} s", flush=True)

    # 2. Exactness.
    for h in check_h:
        for swz in (True, False):
            for name in TIMED if not args.smoke else tuple(lab.VARIANTS):
                key = f"{name} H={h} {'swizzled' if swz else 'linear'}"
                try:
                    report["checks"][key] = check_variant(
                        torch,
                        lab,
                        dev,
                        name,
                        WARPS.get(h, (4,))[0],
                        h,
                        swz,
                        soft,
                        301 if not args.smoke else 8,
                    )
                except Exception as exc:
                    report["checks"][key] = f"ERROR {type(exc).__name__}: {str(exc)[:200]}"
                print(key, report["checks"][key], flush=True)
    save()

    # 3. Copy bandwidth and timings.
    if args.smoke:
        report["copy_bw"] = 1.0
    else:
        bench = _load("bench_public_op")
        cb = bench.copy_bandwidth(bench.CudaDevice(), bench.COPY_BYTES)
        report["copy_methods"] = cb
        report["copy_bw"] = max(cb.get("torch_mul_out", 0.0), cb.get("triton_copy", 0.0))
        print(f"copy bandwidth {report['copy_bw'] / 1e12:.3f} TB/s ({cb})", flush=True)
    for t, h in shapes:
        for normed in (False, True):
            layouts = (True, False) if (t, h, normed) == (shapes[0][0], shapes[0][1], False) else (True,)
            for swz in layouts:
                if elapsed() > args.deadline:
                    report["skipped"].append(f"T={t} H={h} normed={normed} swz={swz} (deadline)")
                    continue
                b = Bufs(torch, dev, t, h, normed, swz)
                for name, w in kernels_for(h, normed, t, lab):
                    row = {"T": t, "H": h, "normed": normed, "swizzled": swz, "kernel": name, "warps": w}
                    try:
                        fn = launcher(name, w, lab, b, soft)
                        us = graph_us(torch, fn) if not args.smoke else (fn(), 1.0)[1]
                        row["us"] = us
                        row["bw_frac"] = b.nbytes() / (us * 1e-6) / report["copy_bw"]
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    report["timings"].append(row)
                del b
                if not args.smoke:
                    torch.cuda.empty_cache()
                save()
    save()
    print(render(report), flush=True)
    return 0


def best_lab(path: pathlib.Path) -> str:
    """``KERNEL:WARPS`` of the lab kernel with the best fraction at T = 8192, H = 4096, no normed
    output, swizzled scales (the shape ncu profiles)."""
    shape = (8192, 4096, False, True)
    rows = [
        r
        for r in json.loads(path.read_text())["timings"]
        if "bw_frac" in r
        and r["kernel"] != "production"
        and (r["T"], r["H"], r["normed"], r["swizzled"]) == shape
    ]
    if not rows:
        return "own_f:8"
    r = max(rows, key=lambda r: r["bw_frac"])
    return f"{r['kernel']}:{r['warps']}"


def render(report: dict) -> str:
    lines = [f"# nvfp4 lab on {report.get('device', 'CPU (smoke)')} {report.get('versions', '')}", ""]
    lines.append(f"Copy bandwidth: {report['copy_bw'] / 1e12:.3f} TB/s {report.get('copy_methods', '')}")
    lines += ["", "## Exactness", ""]
    lines += [f"- {k}: {v}" for k, v in report["checks"].items()]
    lines += ["", "## Graph replay (us per call, fraction of copy bandwidth)", ""]
    lines.append("| T | H | normed | scales | kernel | warps | us | bw |")
    lines.append("|---|---|---|---|---|---|---|---|")
    best: dict[tuple, dict] = {}
    for r in report["timings"]:
        key = (r["T"], r["H"], r["normed"], r["swizzled"])
        bw = f"{r['bw_frac']:.2f}" if "bw_frac" in r else r.get("error", "?")
        lines.append(f"| {r['T']} | {r['H']} | {'yes' if r['normed'] else 'no'} | "
                     f"{'swz' if r['swizzled'] else 'lin'} | {r['kernel']} | {r['warps']} | "
                     f"{r.get('us', float('nan')):.1f} | {bw} |")  # fmt: skip
        if "bw_frac" in r and (key not in best or r["bw_frac"] > best[key]["bw_frac"]):
            best[key] = r
    lines += ["", "## Summary: production (table warps) vs best lab kernel", ""]
    lines.append("| T | H | normed | scales | production | best lab (warps) | best |")
    lines.append("|---|---|---|---|---|---|---|")
    for key, b in best.items():
        prod = next((r for r in report["timings"] if (r["T"], r["H"], r["normed"], r["swizzled"]) == key
                     and r["kernel"] == "production" and "bw_frac" in r), None)  # fmt: skip
        labs = [r for r in report["timings"] if (r["T"], r["H"], r["normed"], r["swizzled"]) == key
                and r["kernel"] != "production" and "bw_frac" in r]  # fmt: skip
        lb = max(labs, key=lambda r: r["bw_frac"]) if labs else None
        lines.append(
            f"| {key[0]} | {key[1]} | {'yes' if key[2] else 'no'} | {'swz' if key[3] else 'lin'} | "
            f"{prod['bw_frac']:.2f} ({prod['warps']}w) | "
            + (f"{lb['kernel']} {lb['bw_frac']:.2f} ({lb['warps']}w)" if lb else "-")
            + f" | {b['kernel']} |"
        )
    per_variant: dict[tuple, list] = {}
    for r in report["timings"]:
        if "bw_frac" in r:
            per_variant.setdefault((r["kernel"], r["warps"]), []).append(r["bw_frac"])
    lines += ["", "## Per kernel: min / mean fraction over the shapes it ran", ""]
    for (k, w), v in sorted(per_variant.items(), key=lambda kv: -min(kv[1])):
        lines.append(f"- {k} {w}w: min {min(v):.2f} mean {sum(v) / len(v):.2f} ({len(v)} shapes)")
    if report["errors"] or report["skipped"]:
        lines += ["", "## Errors / skipped", ""] + [f"- {e}" for e in report["errors"] + report["skipped"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
