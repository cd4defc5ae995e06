"""What nvfp4's two-pass block-scale store costs at large T, and variants of its second pass.

Each column is the public op (``AllReduceNorm(arnorm.LOCAL, ...)``, nvfp4, ``swizzled_128x4``
scales) in one configuration, timed by CUDA-graph replay in interleaved rounds (bench_public_op's
``graph_us``; microseconds per call and the fraction of copy bandwidth):

- ``prod``: production's two-pass store, the launch table's from T 4096 (the fused kernel writes
  its scales linearly into a scratch buffer, ``swizzle_block_scales_kernel`` moves them into the
  layout).
- ``1pass``: one pass, the fused kernel storing the swizzled layout itself.
- ``linear``: ``scale_layout="linear"``, i.e. the first pass alone: a floor for any two-pass store.
- ``handoff`` (diagnostic: wrong scales): the second kernel only waits for the first and lets the
  next grid launch; what a second launch costs with no work in it.
- ``early`` / ``handoff early`` (diagnostics): the second kernel lets the next grid launch before
  its stores. Production must not do this (issue 14: dependents are signalled only after every
  output is written); the columns price the rule.
- ``kcN`` / ``wN``: the swizzle kernel with N scale columns per program / N warps per program.
- ``words``: a swizzle kernel that permutes 32-bit words (a row's 4 scales of one 512-byte tile)
  instead of bytes.

Then each swizzle kernel alone (a graph of 20 launches, no PDL) at T 8192. Every column but
``linear`` is checked byte for byte against ``prod``, each writing into buffers filled with a byte
pattern first (the handoff columns write no scales: they differ).

    python3 lab/lab_two_pass.py [--rounds 5] [--tokens 8192]

``--smoke``: CPU, Triton interpreter, tiny shapes, the checks only (no claims).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import triton
import triton.language as tl

from arnorm_triton._swizzle import swizzle_shape, swizzle_tile_chunk


@triton.jit(do_not_specialize=["n_rows"])
def swizzle_words_kernel(src_ptr, sf_ptr, n_rows, K: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                         USE_PDL: tl.constexpr):  # fmt: skip
    """``swizzle_block_scales_kernel`` on 32-bit words (needs K % 4 == 0): a row's scales of
    columns 4g..4g+3 are one word of the source and one word of the swizzled tile."""
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    GC: tl.constexpr = KC // 4
    rows = tile * 128 + tl.arange(0, 128)
    cols = chunk * GC + tl.arange(0, GC)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    src = src_ptr.to(tl.pointer_type(tl.int32))
    v = tl.load(src + rows.to(tl.int64)[:, None] * (K // 4) + cols[None, :],
                mask=(rows[:, None] < n_rows) & (cols[None, :] < K // 4), other=0)  # fmt: skip
    # [m, g] -> [m // 32, m % 32, g] -> [g, m % 32, m // 32]: word g * 128 + (m % 32) * 4 + m // 32.
    flat = tl.reshape(tl.permute(tl.reshape(v, [4, 32, GC]), [2, 1, 0]), [GC * 128])
    o = tl.arange(0, GC * 128)
    dst = sf_ptr.to(tl.pointer_type(tl.int32))
    base = tile.to(tl.int64) * (KP // 4 * 128) + chunk * (GC * 128)
    tl.store(dst + base + o, flat, mask=o < (KP // 4 - chunk * GC) * 128)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows"])
def swizzle_bytes_early_kernel(src_ptr, sf_ptr, n_rows, K: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                               USE_PDL: tl.constexpr):  # fmt: skip
    """Production's swizzle, signalling the next grid before its stores (a diagnostic)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    swizzle_tile_chunk(src_ptr, sf_ptr, n_rows, tl.program_id(0), tl.program_id(1), K, KP, KC)


@triton.jit(do_not_specialize=["n_rows"])
def handoff_kernel(src_ptr, sf_ptr, n_rows, K: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                   USE_PDL: tl.constexpr):  # fmt: skip
    """No work: the wait on the first pass, then the signal to the next grid (a diagnostic)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows"])
def handoff_early_kernel(src_ptr, sf_ptr, n_rows, K: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                         USE_PDL: tl.constexpr):  # fmt: skip
    """No work: the signal to the next grid, then the wait on the first pass (a diagnostic)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def _shape(kc_max: int) -> Callable[[int], tuple[int, int, int]]:
    """``swizzle_shape`` with at most ``kc_max`` columns per program."""
    return functools.partial(swizzle_shape, kc_max=kc_max)


#: column -> (swizzle kernel or None for production's, columns per program, warps, scale layout,
#: store mode forced on the launcher: None the table's, False one pass, True two passes).
VARIANTS: dict[str, tuple[Any, int, int, str, bool | None]] = {
    "prod": (None, 64, 4, "swizzled_128x4", True),
    "1pass": (None, 64, 4, "swizzled_128x4", False),
    "linear": (None, 64, 4, "linear", None),
    "handoff": (handoff_kernel, 64, 4, "swizzled_128x4", True),
    "handoff early": (handoff_early_kernel, 64, 4, "swizzled_128x4", True),
    "early": (swizzle_bytes_early_kernel, 64, 4, "swizzled_128x4", True),
    "kc32": (None, 32, 4, "swizzled_128x4", True),
    "kc128": (None, 128, 4, "swizzled_128x4", True),
    "w1": (None, 64, 1, "swizzled_128x4", True),
    "w8": (None, 64, 8, "swizzled_128x4", True),
    "words": (swizzle_words_kernel, 64, 4, "swizzled_128x4", True),
}
#: Columns whose outputs are expected to differ from ``prod``'s.
DIAGNOSTIC = ("handoff", "handoff early")


class Swap:
    """Puts a variant's swizzle kernel, shape and warps into ``arnorm_triton._swizzle`` (the launcher
    reads them at every bind) for the ``with`` block."""

    def __init__(self, name: str) -> None:
        self.kernel, self.kc, self.warps = VARIANTS[name][:3]

    def __enter__(self) -> None:
        import arnorm_triton._swizzle as S

        self.saved = (S.swizzle_block_scales_kernel, S.swizzle_shape, S.SWIZZLE_WARPS)
        S.swizzle_block_scales_kernel = self.kernel or self.saved[0]
        S.swizzle_shape, S.SWIZZLE_WARPS = _shape(self.kc), self.warps

    def __exit__(self, *exc: object) -> None:
        import arnorm_triton._swizzle as S

        S.swizzle_block_scales_kernel, S.swizzle_shape, S.SWIZZLE_WARPS = self.saved


def build(dev: Any, name: str, h: int, normed: bool, t: int) -> Any:
    """The public op of column ``name`` for one cell, bound with the variant in place."""
    from bench_public_op import make_op

    layout, mode = VARIANTS[name][3], VARIANTS[name][4]
    with Swap(name):
        op = make_op(dev, h, "nvfp4", normed, max_tokens=t, layout=layout)
        if mode is not None:
            launcher = op._dispatch.table[t].launcher  # a lab script: it forces the store mode
            launcher.fixed_two_pass = mode
            launcher.unbind()
    return op


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no claims")
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from bench_public_op import COPY_BYTES, CpuDevice, CudaDevice, Inputs, bytes_moved, copy_bandwidth

    dev = CpuDevice() if args.smoke else CudaDevice()
    t = 130 if args.smoke else args.tokens  # smoke: a partial last tile, padding rows zeroed
    hiddens = (256,) if args.smoke else (4096, 8192)
    cells = [(256, True)] if args.smoke else [(h, n) for h in hiddens for n in (False, True)]
    names = [n for n in VARIANTS if not (args.smoke and "early" in n)]  # PDL: GPU only
    bw = 0.0 if args.smoke else max(copy_bandwidth(dev, COPY_BYTES).values())
    ops, exact, ref = {}, {}, {}
    with torch.no_grad():
        for c in cells:
            inp = Inputs(dev, t, c[0], "nvfp4")
            for name in names:
                op = build(dev, name, c[0], c[1], t)
                x = inp.x.clone()
                o = op.empty_output(t, inp.scale)  # filled, so a variant that skips a store shows
                for v in (o.residual, o.normed, o.quant.data, o.quant.scale):
                    if v is not None:
                        v.view(torch.uint8).fill_(0xA5)
                with Swap(name):
                    out = op(x, inp.r, inp.w, inp.scale, out=o)
                got = [v.clone().view(torch.uint8) for v in (out.residual, out.quant.data, out.quant.scale)]
                got += [] if out.normed is None else [out.normed.clone().view(torch.uint8)]
                if name != "linear":
                    first = ref.setdefault(c, got)
                    exact[(name, c)] = all(torch.equal(a, b) for a, b in zip(first, got, strict=True))
                ops[(name, c)] = (op, x, inp)
        times: dict[tuple[str, tuple[int, bool]], list[float]] = {}
        for _ in range(0 if args.smoke else args.rounds):  # smoke: the checks only
            for c in cells:
                for name in names:
                    op, x, inp = ops[(name, c)]
                    with Swap(name):
                        us = dev.graph_us(lambda op=op, x=x, inp=inp: op(x, inp.r, inp.w, inp.scale), 20, 9)
                    times.setdefault((name, c), []).append(us)
    print(f"\nnvfp4, T {t}: us per call (median over rounds) and (fraction of copy bandwidth"
          f" {bw / 1e12:.2f} TB/s)")  # fmt: skip
    print("| variant | " + " | ".join(f"H {h}{' normed' if n else ''}" for h, n in cells) + " |")
    print("|---|" + "---:|" * len(cells))
    for name in names:
        row = []
        for c in cells:
            bad = "" if exact.get((name, c), True) else " NOT EXACT"
            if (name, c) not in times:  # smoke
                row.append("checked" + bad)
                continue
            us = statistics.median(times[(name, c)])
            frac = f" ({bytes_moved(t, c[0], 'nvfp4', c[1]) / (us * 1e-6) / bw:.3f})"
            row.append(f"{us:.2f}{frac}{bad}")
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)
    if not args.smoke:
        alone(dev, names, t, hiddens)
    wrong = sorted({n for (n, _), ok in exact.items() if not ok and n not in DIAGNOSTIC})
    if wrong:
        sys.exit(f"lab_two_pass: outputs differ from prod's: {', '.join(wrong)}")


def alone(dev: Any, names: list[str], t: int, hiddens: tuple[int, ...]) -> None:
    """Each swizzle kernel by itself: a graph of 20 launches of T rows, no PDL."""
    import torch

    import arnorm_triton._swizzle as S

    print(f"\nthe swizzle kernel alone, T {t}: us per launch")
    print("| variant | " + " | ".join(f"K {h // 16}" for h in hiddens) + " |")
    print("|---|" + "---:|" * len(hiddens))
    for name in names:
        if VARIANTS[name][4] is not True or "early" in name:
            continue
        row = []
        for h in hiddens:
            k = h // 16
            src = torch.randint(0, 255, (t * k,), dtype=torch.uint8, device=dev.device)
            with Swap(name):
                kp, kc, chunks = S.swizzle_shape(k)
                sf = torch.empty(((t + 127) // 128 * 128 * kp,), dtype=torch.uint8, device=dev.device)
                kernel, warps = S.swizzle_block_scales_kernel, S.SWIZZLE_WARPS

                def launch(kernel: Any = kernel, kp: int = kp, kc: int = kc, chunks: int = chunks,
                           warps: int = warps, src: Any = src, sf: Any = sf, k: int = k) -> None:  # fmt: skip
                    kernel[((t + 127) // 128, chunks)](src, sf, t, K=k, KP=kp, KC=kc, USE_PDL=False,
                                                       num_warps=warps)  # fmt: skip

                row.append(statistics.median(dev.graph_us(launch, 20, 9) for _ in range(3)))
        print(f"| {name} | " + " | ".join(f"{us:.2f}" for us in row) + " |", flush=True)


if __name__ == "__main__":
    main()
