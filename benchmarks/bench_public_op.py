"""The public op on one GPU: ``arnorm.AllReduceNorm`` at TP 1 (``arnorm.LOCAL``, auto selection)
against FlashInfer's single-GPU fused add + RMSNorm (+ fp8 quant), where importable.

Measured in one run, bf16, plain RMSNorm (FlashInfer's kernels are the plain norm):

1. **Eager host time per call** at T = 1 (no CUDA graph: what an engine running eagerly pays per
   layer): the public op, allocating and with caller-provided outputs (``out=``), and a
   breakdown of where its time goes (the backend's fast path with the pointers given, its
   ``__call__``, the launcher with outputs already allocated, the compiled kernel's C launcher
   alone with its arguments prebuilt, one ``torch.empty``); FlashInfer with its output
   preallocated (its API) and with a ``torch.empty`` of it per call. The paths of one case are
   timed in interleaved rounds, so host noise falls on all of them alike.
2. **CUDA-graph replay** of ``--calls`` back-to-back calls (launch gaps removed; median of
   ``--replays``, microseconds per call) for every T, H and format, with and without the normed
   output, in each output layout of ``--layouts`` (``separate``: the normed output in a tensor of
   its own; ``in_place``: over ``hidden_states``, the new residual over ``residual``, as FlashInfer
   writes them), L2 cold then hot (``--l2``):

   - **cold**: the graph cycles through enough buffer sets (inputs, weight and scale; outputs come
     from the graph's pool as in an engine) that between two uses of one set the calls touch more
     than twice the L2 (its size read from the device): every call finds its inputs in DRAM, as a
     norm between two GEMMs of a model does (the GEMMs stream their weights through L2).
   - **hot**: one buffer set replayed, whose inputs stay in L2 from one call to the next where
     they fit (today's figure, and the best case).

   Programmatic dependent launch off for comparison at decode sizes (hot).
3. **Fraction of copy bandwidth** at T >= 8192: the bytes a variant must move over the best
   device-to-device copy measured in the same run (a Triton copy kernel and torch's copies, read
   + write; ``copy_`` alone is a memcpy that a graph runs well below the card's peak).

Targets, marked per row: eager within 1.2x of FlashInfer; graph replay at or below FlashInfer at
every T (same outputs, cold against cold, hot against hot); NVFP4 (every format reported) >= 0.90
of copy bandwidth at T >= 8192. Writes ``public-op-<date>-<gpu>.md`` and ``.json`` to ``--out``
(default ``$OUT`` or ``benchmarks/results``). ``--smoke``: CPU, Triton interpreter, tiny shapes, no
timing claims (a test runs it so the script cannot rot). On the GPU host, from the repository root::

    python benchmarks/bench_public_op.py
    python benchmarks/bench_public_op.py --no-eager --hidden 8192 --tokens 1024 --formats none  # one cell
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

START = time.monotonic()
EPS = 1e-6
#: Bytes each copy of the copy-bandwidth yardstick moves one way. Every benchmark uses this one
#: size, so their fractions of copy bandwidth compare.
COPY_BYTES = 1 << 30
#: name -> (quant, scale layout)
FORMATS: dict[str, tuple[str | None, str | None]] = {
    "none": (None, None),
    "fp8_static": ("fp8_static", None),
    "fp8_per_token": ("fp8_per_token", None),
    "nvfp4": ("nvfp4", "swizzled_128x4"),
    "mxfp8": ("mxfp8", "linear"),
    "fp8_per_group": ("fp8_per_group", "linear"),
    "fp8_per_group_ue8m0_packed": ("fp8_per_group_ue8m0", "packed_ue8m0"),
    "mxfp4": ("mxfp4", "linear"),
}
#: The FlashInfer kernel with the same outputs as an arnorm variant (format, normed output).
FI_RIVAL = {("none", True): "fi_fused_add_rmsnorm", ("fp8_static", False): "fi_fused_add_rmsnorm_quant"}
#: The op's output layouts (``AllReduceNorm(output_layout=...)``); FlashInfer's calls are ``in_place``.
LAYOUTS = ("separate", "in_place")
#: L2 states a graph cell is timed in, in report order.
L2_MODES = ("cold", "hot")
#: Cold: between two uses of one buffer set, the calls touch at least this many times the L2.
COLD_L2_MULTIPLE = 2
#: Cold: at most this many buffer sets (a decode cell's set is tens of KiB: thousands fill the L2).
MAX_SETS = 4096
#: The L2 assumed where the device does not report one (larger than any GPU's today: still cold).
ASSUMED_L2_BYTES = 256 << 20
#: ``--smoke``: the L2 size the rotation is sized against on CPU (no cache is measured there).
SMOKE_L2_BYTES = 1 << 16


def elapsed() -> float:
    return time.monotonic() - START


# -- timing -----------------------------------------------------------------------------------


class CudaDevice:
    """Timing on the GPU: CUDA-graph replay and eager host time."""

    smoke = False

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.device)
        #: The L2 size the device reports (0 where torch does not say).
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0)

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def graph_us(self, fn: Callable[[], Any], calls: int, replays: int) -> float:
        """Median microseconds per call over ``replays`` replays of a graph of ``calls`` calls."""
        cuda = self.torch.cuda
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            for _ in range(2):  # compiles and allocates outside the capture
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

    def eager_all(self, fns: dict[str, Callable[[], Any]], iters: int, rounds: int = 9) -> dict[str, float]:
        """Host microseconds per call of each of ``fns``: best of ``rounds`` rounds, each round timing
        ``iters`` calls of every function in turn (at T = 1 the GPU finishes each call long before
        the host issues the next, so the host is the cost)."""
        for fn in fns.values():
            for _ in range(20):
                fn()
        self.sync()
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(rounds):  # best of several: a lent machine's host has bursts of other work
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - t0) / iters * 1e6)
                self.sync()
        return best


class CpuDevice:
    """``--smoke``: the same calls on CPU tensors, timed by a plain loop (no claims)."""

    smoke = True

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")
        self.l2_bytes = SMOKE_L2_BYTES

    def sync(self) -> None:
        return None

    def graph_us(self, fn: Callable[[], Any], calls: int, replays: int) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6

    def eager_all(self, fns: dict[str, Callable[[], Any]], iters: int, rounds: int = 1) -> dict[str, float]:
        return {name: self.graph_us(fn, iters, 1) for name, fn in fns.items()}


def copy_bandwidth(dev: Any, nbytes: int) -> dict[str, float]:
    """Device-to-device copies of ``nbytes``, bytes read + written per second, by each method."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    n = nbytes // 4
    src = torch.randn(n, device=dev.device)
    dst = torch.empty_like(src)
    block = 4096
    methods = {
        "triton_copy": lambda: _copy[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=4),
        "torch_copy_": lambda: dst.copy_(src),
        "torch_mul_out": lambda: torch.mul(src, 1.0, out=dst),
    }
    out = {}
    for name, fn in methods.items():
        try:
            out[name] = 2 * n * 4 / (dev.graph_us(fn, 5, 7) * 1e-6)
        except Exception as exc:  # one method failing must not cost the others
            print(f"copy {name} failed: {type(exc).__name__}: {exc}", flush=True)
    return out


def bytes_moved(t: int, h: int, fmt: str, normed: bool, elem: int = 2) -> int:
    """Least bytes: read x, residual, weight (and the scale); write residual, normed, codes, scales."""
    from arnorm.plugin import FORMAT_SPECS

    quant, layout = FORMATS[fmt]
    total = 3 * t * h * elem + h * elem + (t * h * elem if normed else 0)
    if quant is None:
        return total
    spec = FORMAT_SPECS[quant]
    rows, cols = spec.data_shape(t, h)
    total += rows * cols  # one byte per code (fp8), or per two (packed fp4)
    shape = spec.scale_shape(t, h, layout)
    if shape is not None:
        scale_bytes = {"float32": 4, "int32": 4}.get(spec.scale_dtype_in(layout) or "", 1)
        total += math.prod(shape) * scale_bytes
    return total + (4 if spec.takes_scale else 0)


def footprint(t: int, h: int, fmt: str, normed: bool, layout: str = "separate", elem: int = 2) -> int:
    """Distinct bytes one call of an in-place op touches, which is what must fit in L2 for a
    replayed call to find its inputs there: :func:`bytes_moved` less one ``[T, H]`` tensor (the new
    residual goes over ``hidden_states``, or in the ``in_place`` layout over ``residual``), and
    less another where the normed output goes over ``hidden_states`` (``in_place``: the same bytes
    move through two ``[T, H]`` tensors where ``separate`` uses three)."""
    total = bytes_moved(t, h, fmt, normed, elem) - t * h * elem
    if normed and layout == "in_place":
        total -= t * h * elem
    return total


def buffer_sets(l2_bytes: int, set_bytes: int, max_sets: int = MAX_SETS) -> int:
    """Buffer sets a cold cell cycles through: enough that the other sets touched between two uses
    of one set hold ``COLD_L2_MULTIPLE`` times the L2 (so none of its lines survive), at least 2,
    at most ``max_sets``."""
    if set_bytes <= 0:
        raise ValueError(f"set_bytes: {set_bytes} (needs > 0)")
    need = -(-COLD_L2_MULTIPLE * max(l2_bytes, 0) // set_bytes) + 1
    return max(2, min(max_sets, need))


def rotation(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One callable that makes the calls of ``calls`` in turn, one per call, cycling."""
    state = [0]
    n = len(calls)

    def call() -> Any:
        i = state[0]
        state[0] = (i + 1) % n
        return calls[i]()

    return call


def calls_per_graph(calls: int, sets: int) -> int:
    """At least ``calls`` calls, a whole number of turns through ``sets`` buffer sets."""
    return sets * -(-max(calls, 1) // sets)


# -- the contenders -----------------------------------------------------------------------------


class Inputs:
    """bf16 inputs of one (T, H, format) and the fp32 scale the format takes."""

    def __init__(self, dev: Any, t: int, h: int, fmt: str) -> None:
        import torch

        g = torch.Generator(device=dev.device).manual_seed(t * 7 + h)
        d = dev.device
        self.t, self.h, self.fmt = t, h, fmt
        self.x = torch.randn((t, h), generator=g, device=d).to(torch.bfloat16)
        self.r = torch.randn((t, h), generator=g, device=d).to(torch.bfloat16)
        self.w = (torch.randn((h,), generator=g, device=d) * 0.1 + 1.0).to(torch.bfloat16)
        scales = {"fp8_static": 0.02, "nvfp4": 448.0 * 6.0 / 8.0}
        self.scale = torch.tensor([scales[fmt]], device=d) if fmt in scales else None

    def copy(self) -> Inputs:
        """Another buffer set with the same values (a cold cell's rotation)."""
        other = object.__new__(Inputs)
        other.t, other.h, other.fmt = self.t, self.h, self.fmt
        other.x, other.r, other.w = self.x.clone(), self.r.clone(), self.w.clone()
        other.scale = None if self.scale is None else self.scale.clone()
        return other


def make_op(
    dev: Any,
    h: int,
    fmt: str,
    normed: bool,
    max_tokens: int,
    pdl: bool = True,
    inplace: bool = True,
    layout: str | None = None,
    output_layout: str = "separate",
) -> Any:
    """The public op at TP 1 for one cell; ``layout`` overrides the format's scale layout."""
    import torch

    import arnorm

    quant, layout = FORMATS[fmt][0], layout or FORMATS[fmt][1]
    # Only where asked: an op of an older arnorm without the keyword still builds the default.
    extra = {} if output_layout == "separate" else {"output_layout": output_layout}
    config = None
    if not pdl:
        config = arnorm.Config(settings={"triton": {"pdl": False}})
    return arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=h, dtype=torch.bfloat16, norm=arnorm.RMSNorm(EPS), quant=quant,
        scale_layout=layout, max_tokens=max_tokens, normed_output=normed, device=dev.device, config=config,
        inplace=inplace, **extra,
    )  # fmt: skip


def check_op(op: Any, inp: Inputs) -> str:
    """One call against the contract: residual bitwise, normed within 1 ulp (bf16)."""
    import torch

    from arnorm.plugin import add_rmsnorm

    x, r = inp.x.clone(), inp.r.clone()
    out = op(x, r, inp.w, inp.scale)
    h_ref, y_ref = add_rmsnorm(inp.x, inp.r, inp.w, EPS, 0.0)
    if not torch.equal(out.residual, h_ref):
        return "FAIL residual"
    if out.normed is not None:
        a, b = out.normed.view(torch.int16).int(), y_ref.view(torch.int16).int()
        a, b = torch.where(a < 0, -(a & 0x7FFF), a), torch.where(b < 0, -(b & 0x7FFF), b)
        if int((a - b).abs().max()) > 1:
            return "FAIL normed"
    return "ok"


def flashinfer_module(args: argparse.Namespace) -> tuple[Any, str]:
    """``(flashinfer.norm or None, version or why absent)``."""
    if args.no_flashinfer:
        return None, "not run (--no-flashinfer)"
    try:
        import flashinfer
        import flashinfer.norm as fi

        return fi, str(getattr(flashinfer, "__version__", "?"))
    except Exception as exc:
        return None, f"absent ({type(exc).__name__}: {str(exc)[:120]})"


def fi_call(fi: Any, inp: Inputs, normed: bool, alloc_per_call: bool = False) -> Callable[[], Any] | None:
    """FlashInfer's call with the outputs of the arnorm variant (``None`` where it has none)."""
    import torch

    if fi is None:
        return None
    x, r = inp.x.clone(), inp.r.clone()
    if inp.fmt == "none" and normed:
        return lambda: fi.fused_add_rmsnorm(x, r, inp.w, EPS)
    if inp.fmt == "fp8_static" and not normed and hasattr(fi, "fused_add_rmsnorm_quant"):
        q = torch.empty((inp.t, inp.h), dtype=torch.float8_e4m3fn, device=x.device)
        if alloc_per_call:

            def call() -> None:
                out = torch.empty((inp.t, inp.h), dtype=torch.float8_e4m3fn, device=x.device)
                fi.fused_add_rmsnorm_quant(out, x, r, inp.w, inp.scale, EPS)

            return call
        return lambda: fi.fused_add_rmsnorm_quant(q, x, r, inp.w, inp.scale, EPS)
    return None


# -- sections -----------------------------------------------------------------------------------


def record(rows: list[dict], errors: dict, where: str, fn: Callable[[], float], **row: Any) -> float | None:
    """Append ``row | {"us": fn()}``; a failure is recorded and the run goes on."""
    try:
        us = fn()
    except Exception as exc:
        errors[where] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"  {where} failed: {errors[where]}", flush=True)
        return None
    rows.append(row | {"us": round(us, 3)})
    return us


def eager_section(args: argparse.Namespace, dev: Any, fi: Any, report: dict) -> None:
    """Host time per eager call at T = 1, with the breakdown of arnorm's. Every path of one case is
    timed round by round in turn (``dev.eager_all``), so a slow phase of the lent host's CPU hits
    arnorm and FlashInfer alike instead of whichever ran then."""
    rows, errors = report["eager"], report["errors"]
    for h in args.hidden:
        for fmt, normed in (("none", True), ("fp8_static", False), ("fp8_static", True)):
            where = f"eager H={h} {fmt} normed={normed}"
            inp = Inputs(dev, 1, h, fmt)
            ops = []
            try:
                ops.append(make_op(dev, h, fmt, normed, max_tokens=64))
                # the launch without the programmatic-dependent-launch attribute: its host cost
                ops.append(make_op(dev, h, fmt, normed, max_tokens=64, pdl=False))
                timed = dev.eager_all(eager_paths(dev, fi, inp, normed, *ops), args.iters, args.eager_rounds)
            except Exception as exc:
                errors[where] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"  {where} failed: {errors[where]}", flush=True)
                timed = {}
            key = {"H": h, "format": fmt, "normed": normed}
            for path, us in timed.items():
                rows.append(key | {"path": path, "us": round(us, 3)})
            for op in ops:
                op.close()


def eager_paths(
    dev: Any, fi: Any, inp: Inputs, normed: bool, op: Any, op_plain: Any
) -> dict[str, Callable[[], Any]]:
    """Label -> a call to time, for one case: the public op and its breakdown, then FlashInfer's.
    Every call is a lambda, as FlashInfer's are (a partial with a keyword argument costs more)."""
    import torch

    h = inp.h
    x, r, w, s = inp.x.clone(), inp.r, inp.w, inp.scale
    out, out_plain = op.empty_output(1, s), op_plain.empty_output(1, s)
    paths: dict[str, Callable[[], Any]] = {
        f"arnorm.AllReduceNorm ({op.backend})": lambda: op(x, r, w, s),
        f"arnorm.AllReduceNorm out= ({op.backend})": lambda: op(x, r, w, s, out=out),
        f"  out=, pdl off ({op_plain.backend})": lambda: op_plain(x, r, w, s, out=out_plain),
    }
    plan = op._plan  # what a call reads (private: a breakdown)
    impl, fast = plan.table[1], plan.fast_table[1]  # the selected backend and its fast path
    if fast is not None:
        xp, rp, wp, sp = x.data_ptr(), r.data_ptr(), w.data_ptr(), 0 if s is None else s.data_ptr()
        paths["  its fast path, out=, pointers given"] = lambda: fast(1, x, r, w, s, out, xp, rp, wp, sp)
    if impl is not None:
        paths["  backend __call__ (allocating)"] = lambda: impl(x, r, w, s)
        launcher = getattr(impl, "launcher", None)
        if launcher is not None:
            y, q, sf = impl._alloc(1)
            label = "  launcher, outputs preallocated" + ("" if launcher.fast else " (kernel[grid])")
            launch = launcher.launch
            paths[label] = lambda: launch(x, r, w, s, x, y, q, sf, 1, h, h, h)
            c_call = prebuilt_launch(launcher, (x, r, w, s, x, y, q, sf), h)
            if c_call is not None:
                paths["    its C launch alone (arguments prebuilt)"] = c_call
    paths["  one torch.empty((1, H))"] = lambda: torch.empty((1, h), dtype=torch.bfloat16, device=dev.device)
    for alloc in (False, True):
        call = fi_call(fi, inp, normed, alloc_per_call=alloc)
        if call is not None:
            paths["flashinfer" + (" + torch.empty of its output" if alloc else " (output preallocated)")] = (
                call
            )
    return paths


def prebuilt_launch(launcher: Any, tensors: tuple[Any, ...], h: int) -> Callable[[], Any] | None:
    """The bound C launcher called with every argument already built (private: where the
    launcher's time goes); ``None`` without a direct launch."""
    if not getattr(launcher, "fast", False):
        return None
    run, grid, function, mid = launcher._entry(1)[:4]
    if run is None:
        return None
    base = tensors[4]
    ptrs = [(base if t is None else t).data_ptr() for t in tensors]
    stream = launcher._get_stream(launcher._device_index)
    full = (grid, 1, 1, stream, function, *mid, *ptrs, 1, h, h, h, *launcher._tail)
    return functools.partial(run, *full)


def graph_cell(dev: Any, args: argparse.Namespace, make_call: Callable[[Inputs], Callable[[], Any]],
               inp: Inputs, set_bytes: int, modes: list[str]) -> dict[str, tuple[float, int]]:  # fmt: skip
    """``{mode: (us per call, buffer sets)}`` of one contender on one cell, for each mode of
    ``modes`` (cold: :func:`buffer_sets` sets in rotation; hot: ``inp`` alone). ``make_call``
    builds the call on one buffer set (FlashInfer's clones its tensors: its own set)."""
    timed: dict[str, tuple[float, int]] = {}
    for mode in modes:
        if mode == "hot":
            timed[mode] = (dev.graph_us(make_call(inp), args.calls, args.replays), 1)
            continue
        sets = buffer_sets(dev.l2_bytes, set_bytes, args.max_sets)
        calls = [make_call(inp if i == 0 else inp.copy()) for i in range(sets)]
        us = dev.graph_us(rotation(calls), calls_per_graph(args.calls, sets), args.replays)
        del calls
        timed[mode] = (us, sets)
    return timed


def graph_section(args: argparse.Namespace, dev: Any, fi: Any, bw: float, report: dict) -> None:
    """Graph replay for every (H, format, normed, layout, T), L2 cold and hot; FlashInfer where it
    has the same outputs."""
    rows, errors, checks = report["graph"], report["errors"], report["checks"]
    P = functools.partial
    variants = [(f, n) for f in args.formats for n in args.normed if not (f == "none" and not n)]
    for tokens in (args.small_tokens, args.large_tokens):
        if not tokens:
            continue
        for h in args.hidden:
            for fmt, normed in variants:
                ops = {}
                wide = args.wide_formats is None or fmt in args.wide_formats
                for layout in args.layouts if wide else args.layouts[:1]:
                    where = f"graph H={h} {fmt} normed={normed} {layout}"
                    if elapsed() > args.deadline:
                        report["skipped"].append(f"{where} T={tokens} (deadline)")
                        continue
                    try:
                        largest = max(args.small_tokens + args.large_tokens)
                        op = make_op(dev, h, fmt, normed, max_tokens=largest, output_layout=layout)
                        t_check = min(7, largest)
                        key = f"H={h} {fmt} normed={normed}" + ("" if layout == "separate" else f" {layout}")
                        checks[key] = check_op(op, Inputs(dev, t_check, h, fmt))
                        ops[layout] = op
                    except Exception as exc:
                        errors[where] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        print(f"  {where} failed: {errors[where]}", flush=True)
                if not ops:
                    continue
                for t in tokens:
                    if elapsed() > args.deadline:
                        report["skipped"].append(f"graph H={h} {fmt} normed={normed} T={t} (deadline)")
                        continue
                    inp = Inputs(dev, t, h, fmt)
                    modes = args.l2 if wide else args.l2[-1:]
                    base = {
                        "T": t,
                        "H": h,
                        "format": fmt,
                        "normed": normed,
                        "bytes": bytes_moved(t, h, fmt, normed),
                    }
                    for layout, op in ops.items():
                        where = f"graph H={h} {fmt} normed={normed} {layout} T={t}"
                        cell = base | {"layout": layout, "footprint": footprint(t, h, fmt, normed, layout)}

                        def arnorm_call(i: Inputs, op: Any = op) -> Callable[[], Any]:
                            return P(op, i.x.clone(), i.r, i.w, i.scale)

                        timer = P(graph_cell, dev, args, arnorm_call, inp, cell["footprint"], modes)
                        record_modes(rows, errors, where, timer, **cell, impl=f"arnorm ({op.backend})")
                    if fi_call(fi, inp, normed) is not None:
                        cell = base | {
                            "layout": "in_place",
                            "footprint": footprint(t, h, fmt, normed, "in_place"),
                        }
                        fi_make = P(fi_call, fi, normed=normed)
                        timer = P(graph_cell, dev, args, fi_make, inp, cell["footprint"], modes)
                        where = f"graph H={h} {fmt} normed={normed} T={t} fi"
                        record_modes(rows, errors, where, timer, **cell, impl=FI_RIVAL[(fmt, normed)])
                for op in ops.values():
                    op.close()
                print(f"[{elapsed():6.1f}s] graph H={h} {fmt} normed={normed} T={tokens}", flush=True)
    if elapsed() > args.deadline:
        report["skipped"].append("pdl off (deadline)")
        return
    if not args.small_tokens or args.no_pdl_off:
        return
    for h in args.hidden:
        for fmt, normed in (("none", True), ("fp8_static", False)):
            if fmt not in args.formats:
                continue
            try:
                op = make_op(dev, h, fmt, normed, max_tokens=max(args.small_tokens), pdl=False)
            except Exception as exc:
                errors[f"pdl off H={h} {fmt}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                continue
            for t in args.small_tokens:
                inp = Inputs(dev, t, h, fmt)
                base = {"T": t, "H": h, "format": fmt, "normed": normed, "layout": "separate", "l2": "hot",
                        "bytes": bytes_moved(t, h, fmt, normed), "sets": 1}  # fmt: skip
                base["footprint"] = footprint(t, h, fmt, normed)
                timer = P(
                    dev.graph_us, P(op, inp.x.clone(), inp.r, inp.w, inp.scale), args.calls, args.replays
                )
                record(rows, errors, f"pdl off H={h} {fmt} T={t}", timer, **base,
                       impl=f"arnorm ({op.backend}, pdl off)")  # fmt: skip
            op.close()


def record_modes(rows: list[dict], errors: dict, where: str, fn: Callable[[], dict], **row: Any) -> None:
    """One row per L2 mode of ``fn()`` (``{mode: (us, sets)}``); a failure is recorded and the run goes on."""
    try:
        timed = fn()
    except Exception as exc:
        errors[where] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"  {where} failed: {errors[where]}", flush=True)
        return
    for mode, (us, sets) in timed.items():
        rows.append(row | {"l2": mode, "sets": sets, "us": round(us, 3)})


def judge(report: dict, bw: float) -> None:
    """Fill each arnorm row's verdict against the issue's targets."""
    eager = report["eager"]
    for r in eager:
        r["verdict"] = ""
        if not r["path"].startswith("arnorm"):
            continue
        # Like for like: the call with out= writes into the caller's buffers, as FlashInfer with
        # its output preallocated does; the allocating call allocates its outputs, as FlashInfer
        # does with a torch.empty of its output. FlashInfer's `none` allocates nothing (it writes
        # the normed output and the residual into its two inputs), so only out= matches it.
        allocating = " out= " not in r["path"]
        if allocating and r["format"] == "none":
            r["verdict"] = "allocates (FlashInfer writes into its inputs: the out= row is like for like)"
            continue
        rival = "flashinfer + torch.empty of its output" if allocating else "flashinfer (output preallocated)"
        same = (r["H"], r["format"], r["normed"])
        fi = [e for e in eager if e["path"] == rival and (e["H"], e["format"], e["normed"]) == same]
        if fi:
            ratio = r["us"] / fi[0]["us"]
            against = "fi + torch.empty" if allocating else "fi"
            r["verdict"] = f"{ratio:.2f}x {against} " + ("met" if ratio <= 1.2 else "MISSED (target 1.2x)")
    graph = report["graph"]
    for r in graph:
        r["pct_bw"] = round(100.0 * r["bytes"] / (r["us"] * 1e-6) / bw, 1) if bw else 0.0
        if not r["impl"].startswith("arnorm") or "pdl off" in r["impl"]:
            r["verdict"] = ""
            continue
        notes = []
        rival = FI_RIVAL.get((r["format"], r["normed"]))
        mode = r.get("l2", "hot")
        same = [
            g for g in graph
            if g["impl"] == rival and (g["T"], g["H"], g.get("l2", "hot")) == (r["T"], r["H"], mode)
        ]  # fmt: skip
        if same:
            ratio = r["us"] / same[0]["us"]
            notes.append(f"{ratio:.2f}x fi " + ("met" if ratio <= 1.0 else "MISSED (target <= 1.0x)"))
        if r["T"] >= 8192:
            ok = r["pct_bw"] >= 90.0
            target = "met" if ok else ("MISSED (target 90%)" if r["format"] == "nvfp4" else "below 90%")
            notes.append(f"bw {r['pct_bw']:.0f}% {target}")
        r["verdict"] = "; ".join(notes)


def markdown(report: dict) -> str:
    lines = [
        f"# The public op at TP 1, {report['gpu']} ({report['date']})",
        "",
        f"torch {report['torch']}, triton {report['triton']}, flashinfer {report['flashinfer']}. bf16, plain "
        f"RMSNorm, eps {EPS}. `arnorm.AllReduceNorm(arnorm.LOCAL, ...)` with auto selection.",
        f"L2: {size(report.get('l2_bytes', 0))} ({report.get('l2_source', 'device properties')}).",
        f"Copy bandwidth (best of {', '.join(f'{k} {v / 1e12:.2f}' for k, v in report['copy_bw'].items())} "
        f"TB/s; read + write): {report['copy_bw_best'] / 1e12:.2f} TB/s.",
    ]
    if report["smoke"]:
        lines += [
            "",
            "**Smoke run on CPU (Triton interpreter): the figures below are not timings of anything.**",
        ]
    lines += [
        "",
        "Correctness (one call, T = 7 or the largest T): "
        + ", ".join(f"{k}: {v}" for k, v in report["checks"].items()),
        "",
    ]
    lines += [f"Error: {k}: {v}" for k, v in report["errors"].items()]
    lines += [f"Skipped: {s}" for s in report["skipped"]]
    lines += [
        "",
        f"## Eager host time per call, T = 1 ({report['iters']} calls, "
        f"best of {report['eager_rounds']} interleaved rounds)",
        "",
    ]
    lines += ["| H | format | normed out | path | us/call | verdict |", "|---:|---|---|---|---:|---|"]
    for r in report["eager"]:
        normed = "yes" if r["normed"] else "no"
        lines.append(
            f"| {r['H']} | {r['format']} | {normed} | {r['path']} | {r['us']:.2f} | {r.get('verdict', '')} |"
        )
    lines += graph_tables(report)
    missed = [r for r in report["eager"] + report["graph"] if "MISSED" in r.get("verdict", "")]
    lines += ["", f"Targets missed: {len(missed)}. Run time {report['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def size(nbytes: int) -> str:
    """``50 MiB``; ``64 KiB`` below a MiB."""
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 2**10:.0f} KiB"


def graph_tables(report: dict) -> list[str]:
    """The graph-replay tables, L2 cold first, then hot (rows of neither mode: a run before both)."""
    lines: list[str] = []
    heads = {
        "cold": f"L2 cold: buffer sets in rotation, more than {COLD_L2_MULTIPLE}x the L2 "
        f"({size(report.get('l2_bytes', 0))}) between two uses of one set",
        "hot": "L2 hot: one buffer set replayed (its inputs stay in L2 where they fit)",
    }
    order = {"none": 0, **{f: i for i, f in enumerate(FORMATS)}}
    for mode in L2_MODES:
        rows = [r for r in report["graph"] if r.get("l2", "hot") == mode]
        if not rows:
            continue
        lines += [
            "",
            f"## CUDA-graph replay, {heads[mode]}; at least {report['calls']} calls per graph, "
            f"median of {report['replays']}",
            "",
            "| T | H | format | normed out | layout | impl | MB moved | MB touched | sets | us | % copy bw "
            "| verdict |",
            "|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        key = lambda r: (r["H"], order[r["format"]], not r["normed"], r["T"], r.get("layout", ""), r["impl"])  # noqa: E731
        for r in sorted(rows, key=key):
            normed = "yes" if r["normed"] else "no"
            layout = r.get("layout", "separate")
            lines.append(
                f"| {r['T']} | {r['H']} | {r['format']} | {normed} | {layout} | {r['impl']} | "
                f"{r['bytes'] / 1e6:.2f} | {r.get('footprint', r['bytes']) / 1e6:.2f} | {r.get('sets', 1)} | "
                f"{r['us']:.2f} | {r.get('pct_bw', 0.0):.1f} | {r.get('verdict', '')} |"
            )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing claims"
    )
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--iters", type=int, default=2000, help="eager calls per timing")
    p.add_argument("--eager-rounds", type=int, default=9, help="eager rounds (best of) per path")
    p.add_argument("--deadline", type=float, default=150.0, help="seconds; later graph rows are skipped")
    p.add_argument("--no-flashinfer", action="store_true", help="do not import FlashInfer")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    # A focused run (one cell and its neighbours): the same sections, fewer cells.
    p.add_argument("--hidden", type=_ints, default=[4096, 8192], help="comma-separated hidden sizes")
    p.add_argument("--tokens", type=_ints, default=[1, 16, 128, 1024, 8192], help="comma-separated T")
    p.add_argument("--formats", type=_names, default=list(FORMATS), help="comma-separated formats")
    p.add_argument("--no-eager", action="store_true", help="skip the eager host-time section")
    p.add_argument(
        "--l2", type=_modes, default=list(L2_MODES), help="comma-separated: cold, hot (in that order)"
    )
    p.add_argument("--layouts", type=_layouts, default=["separate"], help="comma-separated output layouts")
    p.add_argument("--max-sets", type=int, default=MAX_SETS, help="cold: most buffer sets in rotation")
    p.add_argument("--no-pdl-off", action="store_true", help="skip the pdl-off rows")
    p.add_argument(
        "--normed", choices=("yes", "no", "both"), default="both",
        help="quantized formats: graph rows with the normed output, without it, or both",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.normed = {"yes": (True,), "no": (False,), "both": (True, False)}[args.normed]
    # Decode sizes (T <= 128) are timed first, and again with programmatic dependent launch off.
    args.small_tokens = [t for t in args.tokens if t <= 128]
    args.large_tokens = [t for t in args.tokens if t > 128]
    args.wide_formats = None  # formats timed in every layout and L2 mode (None: all)
    if args.smoke:
        args.hidden, args.small_tokens, args.large_tokens = [256], [1, 3], [5]
        args.calls, args.replays, args.iters = 2, 1, 2
        # Every layout and L2 mode on one format only: an interpreted call takes up to a second.
        args.layouts, args.max_sets, args.wide_formats = list(LAYOUTS), min(args.max_sets, 3), ["none"]
    return args


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _choices(flag: str, allowed: tuple[str, ...], text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        msg = f"{flag}: {', '.join(unknown) or repr(text)} (needs some of {', '.join(allowed)})"
        raise argparse.ArgumentTypeError(msg)
    return [n for n in allowed if n in names]  # report order, whatever the order given


def _modes(text: str) -> list[str]:
    return _choices("--l2", L2_MODES, text)


def _layouts(text: str) -> list[str]:
    return _choices("--layouts", LAYOUTS, text)


def _names(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        msg = f"--formats: {', '.join(unknown)} (needs some of {', '.join(FORMATS)})"
        raise argparse.ArgumentTypeError(msg)
    return names


def open_device(smoke: bool, script: str) -> tuple[Any, dict[str, Any]]:
    """The device a run times on, and its report's opening fields (``smoke``: CPU, the Triton
    interpreter; else a CUDA GPU, or exit saying so)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton's kernels
    import torch
    import triton

    if not smoke and not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA GPU (or --smoke)")
    head = {
        "date": datetime.date.today().isoformat(),
        "gpu": "CPU (smoke)" if smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "smoke": smoke,
    }  # fmt: skip
    return (CpuDevice() if smoke else CudaDevice()), head


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev, head = open_device(args.smoke, "bench_public_op")
    import torch

    fi, fi_version = flashinfer_module(args)
    copies = copy_bandwidth(dev, 1 << 16 if args.smoke else COPY_BYTES)
    bw = max(copies.values(), default=0.0)
    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s; L2 {size(dev.l2_bytes)}; flashinfer {fi_version}", flush=True
    )
    report: dict[str, Any] = {
        **head, "flashinfer": fi_version, "copy_bw": copies, "copy_bw_best": bw, "calls": args.calls,
        "replays": args.replays, "iters": args.iters, "eager_rounds": args.eager_rounds, "checks": {},
        "errors": {}, "skipped": [], "eager": [], "graph": [], "l2_bytes": dev.l2_bytes,
        "l2_source": "smoke: no cache measured" if args.smoke else "torch.cuda.get_device_properties",
        "l2_modes": args.l2, "layouts": args.layouts,
    }  # fmt: skip
    if not dev.l2_bytes:
        dev.l2_bytes = report["l2_bytes"] = ASSUMED_L2_BYTES
        report["l2_source"] = "not reported by the device: assumed"
    with torch.no_grad():
        if not args.no_eager:
            eager_section(args, dev, fi, report)
            print(f"[{elapsed():6.1f}s] eager done", flush=True)
        graph_section(args, dev, fi, bw, report)
    report["seconds"] = elapsed()
    judge(report, bw)
    write_report(report, "public-op", markdown(report), args.out)
    return 0


def write_report(report: dict, prefix: str, text: str, out_dir: str) -> None:
    """``<prefix>-<date>-<gpu>.md`` (``text``) and ``.json`` (``report``) in ``out_dir``; prints the table."""
    stem = f"{prefix}-{report['date']}-{report['gpu'].replace(' ', '-').replace('(', '').replace(')', '')}"
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(text)
    print(f"wrote {out / stem}.md and .json")


if __name__ == "__main__":
    sys.exit(main())
