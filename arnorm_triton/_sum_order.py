"""The order in which a row's squares are summed: a tree on the GPU, torch's own order on the CPU.

The statistic ``sum(h**2)`` is an fp32 sum of ``H`` terms; its last bit depends on the order of
the additions. A GPU kernel sums in a tree (:func:`tl.sum`), which is within an ulp of any other
order and fast. Under the Triton interpreter the fused kernel runs on CPU tensors, next to
torch-native norms (arnorm's reference, vLLM's ``GemmaRMSNorm`` and ``RMSNorm`` on CPU, Hugging
Face's norms), which compute ``x.pow(2).mean(-1)`` with ATen's CPU sum. A different order there
moves ``rsqrt`` by an ulp now and then, and the normed output by one ulp of ``D`` in a few values
in 10^4 (fp16) or 10^5 (bf16): the only difference left between arnorm's drop-ins and vLLM's helpers
on CPU. So the interpreted kernel sums in ATen's order, which this module writes down:

ATen's ``vectorized_inner_sum`` (``aten/src/ATen/native/cpu/SumKernel.cpp``) reads a contiguous
row as vectors of ``L`` lanes (``L`` = ``Vectorized<float>::size()``); ``row_sum`` groups the
vectors four at a time (``ilp_factor``), and ``multi_row_sum`` adds the groups into one accumulator
of ``4 * L`` lanes, cascading it into a second accumulator every 16 groups and into a third every
256 (``num_levels = 4``, ``level_power = 4`` for rows under ``2**20`` groups), then adds the levels
up. Leftover vectors go into the first ``L`` lanes; the four ``L``-lane parts are added in order;
a scalar tail ``H mod L`` is summed first, then the ``L`` lanes one by one. A row shorter than one
vector (``H < L``) takes ATen's scalar path instead: ``row_sum`` over scalars, four columns summed
down, the tail added into the first, then the four columns in order.

``L`` is a property of the torch build and the CPU (8 with AVX2 kernels, 16 with AVX512 ones), so
:func:`torch_sum_lanes` measures it once, against torch itself, and returns 0 (the tree) when
neither candidate reproduces torch: the result is then within an ulp, as on the GPU, not bitwise.
Exact only while ATen sums a row in one thread: ``T * H`` under ATen's grain of 32,768 elements,
or more than one row (a lone row larger than that is split across threads).
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl
from triton.language.standard import _sum_combine as _add

__all__ = ["LEVEL_ROWS", "aten_row_sum", "aten_sum", "torch_sum_lanes"]

#: multi_row_sum's cascade: a level closes every 16 groups of the level below (level_power 4).
LEVEL_ROWS = 16
#: The widest row (in 4-vector groups) whose cascade has the three levels written below.
_MAX_GROUPS = LEVEL_ROWS**3


def aten_row_sum(values: object, lanes: int) -> float:
    """ATen's CPU sum of the 1-D fp32 array ``values`` in ATen's order with ``lanes`` lanes
    (numpy, float32 at every step): what :func:`aten_sum` computes, written plainly."""
    import numpy as np

    q = np.asarray(values, dtype=np.float32)
    n = q.shape[0]
    if n < lanes:
        return _scalar_row_sum(q)
    vectors, width = n // lanes, 4 * lanes
    groups = vectors // 4
    if groups >= _MAX_GROUPS:
        raise ValueError(f"values: {n} elements (needs fewer than {_MAX_GROUPS * width} for {lanes} lanes)")
    acc = [np.zeros(width, np.float32) for _ in range(3)]
    for g in range(groups):
        acc[0] = acc[0] + q[g * width : (g + 1) * width]
        if (g + 1) % LEVEL_ROWS == 0:
            acc[1], acc[0] = acc[1] + acc[0], np.zeros(width, np.float32)
            if (g + 1) % LEVEL_ROWS**2 == 0:
                acc[2], acc[1] = acc[2] + acc[1], np.zeros(width, np.float32)
    parts = ((acc[0] + acc[1]) + acc[2]).reshape(4, lanes)
    first = parts[0]
    for v in range(4 * groups, vectors):
        first = first + q[v * lanes : (v + 1) * lanes]
    folded = ((first + parts[1]) + parts[2]) + parts[3]
    total = np.float32(0.0)
    for x in q[vectors * lanes :]:
        total = np.float32(total + x)
    for x in folded:
        total = np.float32(total + x)
    return float(total)


def _scalar_row_sum(q: Any) -> float:
    """ATen's sum of a row shorter than a vector (``cascade_sum`` takes ``scalar_inner_sum``):
    ``row_sum`` of scalars, four columns summed down, the tail added into column 0, then the four
    columns in order."""
    import numpy as np

    n = len(q)
    rows = n // 4
    cols = [np.float32(0.0)] * 4
    for i in range(rows):
        for k in range(4):
            cols[k] = np.float32(cols[k] + q[4 * i + k])
    for x in q[4 * rows :]:
        cols[0] = np.float32(cols[0] + x)
    total = cols[0]
    for k in range(1, 4):
        total = np.float32(total + cols[k])
    return float(total)


@functools.cache
def torch_sum_lanes() -> int:
    """The lane count with which :func:`aten_row_sum` reproduces torch's CPU sum here (8 or 16),
    or 0 when neither does. Probed on rows whose sums depend on the order (values of many
    magnitudes, lengths with every kind of remainder)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(44)
    rows = []
    for n in (4099, 1000, 8 * 64 * 16 + 24):
        exponents = rng.integers(-20, 20, n)
        rows.append((rng.random(n) * np.exp2(exponents)).astype(np.float32))
    for lanes in (8, 16):
        if all(torch.from_numpy(r).sum().item() == aten_row_sum(r, lanes) for r in rows):
            return lanes
    return 0


@triton.jit
def _short_row_sum(sq, HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_scalar_row_sum` for the kernel (``HIDDEN`` under one vector)."""
    ROWS: tl.constexpr = HIDDEN // 4
    at = tl.arange(0, BLOCK)
    k = tl.arange(0, 4)
    r = tl.arange(0, BLOCK // 4)[:, None]
    grid = tl.reshape(tl.where(at < ROWS * 4, sq, 0.0), [BLOCK // 4, 4])
    cols = tl.reduce(tl.where(r == BLOCK // 4 - 1, tl.associative_scan(grid, 0, _add), 0.0), 0, _add)
    col0 = tl.reduce(tl.where(k == 0, cols, 0.0), 0, _add)
    # Column 0, then the tail one by one: a fold of the tail with column 0 put at the front (when
    # there is no row, column 0 is zero and entry 0 is the tail's first).
    chain = tl.where((at >= ROWS * 4) & (at < HIDDEN), sq, 0.0) + tl.where(at == 0, col0, 0.0)
    first = tl.reduce(tl.where(at == BLOCK - 1, tl.associative_scan(chain, 0, _add), 0.0), 0, _add)
    cols = tl.where(k == 0, first, cols)
    return tl.reduce(tl.where(k == 3, tl.associative_scan(cols, 0, _add), 0.0), 0, _add)


@triton.jit
def aten_sum(sq, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr):
    """The fp32 sum of ``sq`` (``[BLOCK]``, zero at and beyond ``HIDDEN``) in ATen's CPU order with
    ``LANES`` lanes (:func:`aten_row_sum`), for the interpreter only: the GPU kernels sum in a tree.

    A fold ``((0 + x[0]) + x[1]) + ...`` along an axis is the last entry of a sum scan: under the
    interpreter that is numpy's ``cumsum``, fp32 additions one after the other (compiled, a scan
    adds in a tree, hence the GPU kernels' tree; tests pin this function bit for bit to torch). The
    last entry is taken exactly, as a sum of it and zeros. Zeros added at the end of a fold change
    nothing (the squares are >= +0), so every level folds whole power-of-two blocks with the
    entries outside its range masked to zero.

    Why ``tl.reduce`` / ``tl.associative_scan`` with ``_add`` and not ``tl.sum`` / ``tl.cumsum``,
    and one function: those two are jit functions, and the interpreter re-patches all of
    ``triton.language`` on every jit call, which cost more than this arithmetic (5x the kernel).
    With the standard sum combine it still runs numpy's ``sum`` / ``cumsum``."""
    if HIDDEN < LANES:
        return _short_row_sum(sq, HIDDEN, BLOCK)
    WIDTH: tl.constexpr = 4 * LANES
    ROWS: tl.constexpr = BLOCK // WIDTH
    VECTORS: tl.constexpr = HIDDEN // LANES
    GROUPS: tl.constexpr = VECTORS // 4
    FULL: tl.constexpr = GROUPS // 16  # LEVEL_ROWS: the interpreter cannot take int // constexpr
    tl.static_assert(GROUPS < 4096)  # _MAX_GROUPS
    at = tl.arange(0, BLOCK)
    # (A step is skipped when its range is empty: each costs the interpreter.)
    if GROUPS * WIDTH < BLOCK:
        sq_groups = tl.where(at < GROUPS * WIDTH, sq, 0.0)
    else:
        sq_groups = sq
    grouped = tl.reshape(sq_groups, [ROWS, WIDTH])
    if ROWS < 16:  # one level: every group is in the first accumulator
        r = tl.arange(0, ROWS)[:, None]
        acc = tl.reduce(tl.where(r == ROWS - 1, tl.associative_scan(grouped, 0, _add), 0.0), 0, _add)
    else:
        CHUNKS: tl.constexpr = ROWS // 16
        j = tl.arange(0, 16)[None, :, None]
        runs = tl.associative_scan(tl.reshape(grouped, [CHUNKS, 16, WIDTH]), 1, _add)
        chunk = tl.reduce(tl.where(j == 15, runs, 0.0), 1, _add)
        c = tl.arange(0, CHUNKS)[:, None]
        acc0 = tl.reduce(tl.where(c == FULL, chunk, 0.0), 0, _add)  # the open chunk (zeros when none)
        closed = tl.where(c < FULL, chunk, 0.0)
        if CHUNKS < 16:
            closed_run = tl.associative_scan(closed, 0, _add)
            acc = acc0 + tl.reduce(tl.where(c == CHUNKS - 1, closed_run, 0.0), 0, _add)
        else:
            SUPER: tl.constexpr = CHUNKS // 16
            level_runs = tl.associative_scan(tl.reshape(closed, [SUPER, 16, WIDTH]), 1, _add)
            level = tl.reduce(tl.where(j == 15, level_runs, 0.0), 1, _add)
            g = tl.arange(0, SUPER)[:, None]
            acc1 = tl.reduce(tl.where(g == FULL // 16, level, 0.0), 0, _add)
            open_run = tl.associative_scan(tl.where(g < FULL // 16, level, 0.0), 0, _add)
            acc2 = tl.reduce(tl.where(g == SUPER - 1, open_run, 0.0), 0, _add)
            acc = (acc0 + acc1) + acc2
    # Part 0 with the leftover vectors (at most 3) added into it, then parts 1-3 in order.
    parts = tl.reshape(acc, [4, LANES])
    p = tl.arange(0, 4)[:, None]
    if 4 * GROUPS < VECTORS:
        v = tl.arange(0, BLOCK // LANES)[:, None]
        vectors = tl.reshape(sq, [BLOCK // LANES, LANES])
        part0 = tl.reduce(tl.where(p == 0, parts, 0.0), 0, _add)[None, :]
        # Row 0 holds part 0 (zero when row 0 is itself a leftover: then there are no groups).
        chain = tl.where((v >= 4 * GROUPS) & (v < VECTORS), vectors, 0.0) + tl.where(v == 0, part0, 0.0)
        chain_run = tl.associative_scan(chain, 0, _add)
        first = tl.reduce(tl.where(v == BLOCK // LANES - 1, chain_run, 0.0), 0, _add)
        parts = tl.where(p == 0, first[None, :], parts)
    folded = tl.reduce(tl.where(p == 3, tl.associative_scan(parts, 0, _add), 0.0), 0, _add)
    # The scalar tail first, then the lanes one by one.
    lane = tl.arange(0, LANES)
    if VECTORS * LANES < HIDDEN:
        tail_only = tl.where((at >= VECTORS * LANES) & (at < HIDDEN), sq, 0.0)
        tail = tl.reduce(tl.where(at == BLOCK - 1, tl.associative_scan(tail_only, 0, _add), 0.0), 0, _add)
        folded = tl.where(lane == 0, folded + tail, folded)
    return tl.reduce(tl.where(lane == LANES - 1, tl.associative_scan(folded, 0, _add), 0.0), 0, _add)
