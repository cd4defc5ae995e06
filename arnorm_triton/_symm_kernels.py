"""The ``triton_symm`` kernels: the all-reduce over symmetric memory, then ``triton``'s epilogue.

Rows map to programs as ``b = t % SLOTS`` in every call (``SLOTS`` fixed per op), and every
access to row ``t`` of any rank's buffer is made by program ``b`` of some rank. So the ranks only
ever need to agree per program: program ``b`` of each rank synchronizes with program ``b`` of
every other rank through flags, never with the rest of the grid (docs/triton-symm.md).

Per call, program ``b`` has an epoch ``e`` (its call counter, ``epochs[b] + 1``; equal on every
rank because every rank runs the same calls with the same grid). Flags hold epochs, only ever
increase (mod 2**32) and are never reset, so they survive any number of CUDA-graph replays:

- ``signal(kind)``: ``__syncthreads``, then one release store of ``e`` at system scope into
  flag ``(kind, b, rank)`` of every rank's buffer (this rank's included).
- ``wait(kind, target)``: acquire-poll this rank's flags ``(kind, b, src)`` for every ``src``
  until each is at least ``target`` (wrap-safe compare), then ``__syncthreads``.

One-shot, program ``b``:

1. (copy-in) wait DONE >= e - 1 (every peer has finished reading the previous call's rows from
   this buffer), copy this rank's rows into its inputs region; signal READY; wait READY >= e.
2. for each row: ``s = D(sum_r fp32(inputs_r[t]))`` from rank 0 up; the epilogue.
3. signal DONE; with ``end_wait`` (zero-copy input in use) wait DONE >= e before exiting, so the
   next writer of the inputs region (the caller's GEMM) cannot overwrite rows a peer still reads.

Two-shot: 1 as above; 2: this rank reduces the rows of program ``b`` that it owns
(``owner(t) = (t % SLOTS + t // SLOTS) % W``) into its sums region, signal SUMS, wait SUMS >= e;
3: every row's ``s`` from its owner's sums region, the epilogue; then DONE as above.

``SYNC=False`` compiles every flag operation out and ``STAGE`` runs one part only (1: publish,
2: one-shot sums and epilogue or two-shot reduction, 3: two-shot epilogue and the call's end):
the CPU tests run each emulated rank's stage 1, then each rank's stage 2, then stage 3, which is
exactly the order the flags enforce. ``STAGE=0`` runs the whole kernel. The kind (one-/two-shot),
copy-in and end-wait are runtime flags, so one compiled kernel serves every call of an op.
"""

from __future__ import annotations

import triton
import triton.language as tl

from arnorm_triton._casts import to_dtype_rne, to_fp32
from arnorm_triton._kernels import PAD_ROWS_PER_PROGRAM, norm_quant_epilogue, row_offsets, zero_padding_rows

__all__ = ["DONE", "READY", "SUMS", "symm_allreduce_norm_kernel", "symm_wait_done_kernel"]

#: Flag kinds (the first axis of the flags region).
READY = tl.constexpr(0)
SUMS = tl.constexpr(1)
DONE = tl.constexpr(2)


@triton.jit
def _flag_ptr(base, kind, b, src, SLOTS: tl.constexpr, WORLD: tl.constexpr):
    """Flag ``(kind, b, src)`` in the buffer at integer address ``base`` (flags start at offset 0)."""
    return (base + ((kind * SLOTS + b) * WORLD + src) * 4).to(tl.pointer_type(tl.uint32))


@triton.jit
def _behind(v, target):
    """``v < target`` on the epoch circle (uint32, wrap-safe while the two are < 2**31 apart)."""
    return ((v - target) >> 31) != 0


@triton.jit
def _signal(peers_ptr, kind, b, rank, e, SLOTS: tl.constexpr, WORLD: tl.constexpr):
    # Every thread's stores (the rows just written) happen before the release below.
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        base = tl.load(peers_ptr + p)
        tl.atomic_xchg(_flag_ptr(base, kind, b, rank, SLOTS, WORLD), e, sem="release", scope="sys")


@triton.jit
def _wait(peers_ptr, kind, b, rank, target, spin_limit, err_ptr, SLOTS: tl.constexpr, WORLD: tl.constexpr):
    mine = tl.load(peers_ptr + rank)
    for p in tl.static_range(WORLD):
        flag = _flag_ptr(mine, kind, b, p, SLOTS, WORLD)
        v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        n = tl.full([], 0, tl.int32)
        while _behind(v, target) & (n < spin_limit):
            v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            n += 1
        if _behind(v, target):
            # A peer never came: record it (TritonSymmBackend.check raises) rather than hang.
            tl.atomic_or(err_ptr, tl.full([], 1, tl.int32) << kind, sem="relaxed", scope="gpu")
    # Every thread's loads of peer rows happen after the acquire above.
    tl.debug_barrier()


@triton.jit
def _region(peers_ptr, p, offset, DTYPE: tl.constexpr):
    """Rank ``p``'s region at byte ``offset`` as a pointer to ``DTYPE`` (16-byte aligned)."""
    return tl.multiple_of((tl.load(peers_ptr + p) + offset).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def _rank_order_sum(peers_ptr, in_off, row64, offs, mask, HIDDEN: tl.constexpr, WORLD: tl.constexpr,
                    DTYPE: tl.constexpr, SOFT: tl.constexpr):  # fmt: skip
    """``fp32(D(sum_r fp32(x_r[row])))``, accumulated in fp32 from rank 0 up (the reference's step 1;
    starting from rank 0's value, not 0.0, keeps a sum of negative zeros negative)."""
    acc = to_fp32(tl.load(_region(peers_ptr, 0, in_off, DTYPE) + row64 * HIDDEN + offs, mask=mask, other=0.0),
                  SOFT)  # fmt: skip
    for p in tl.static_range(1, WORLD):
        x = tl.load(_region(peers_ptr, p, in_off, DTYPE) + row64 * HIDDEN + offs, mask=mask, other=0.0)
        acc = acc + to_fp32(x, SOFT)
    return to_fp32(to_dtype_rne(acc, DTYPE, SOFT), SOFT)


@triton.jit(
    do_not_specialize=["n_rows", "rank", "spin_limit", "two_shot", "copy_in", "end_wait"],
    do_not_specialize_on_alignment=["scale_ptr"],
)
def symm_allreduce_norm_kernel(
    x_ptr,  # [T, H] this rank's partial (row stride x_stride); read only when copy_in
    res_ptr,  # [T, H] residual in D
    w_ptr,  # [H] norm weight in D
    scale_ptr,  # fp32 [1]: fp8_static dequant scale / nvfp4 global encode scale (else any pointer)
    h_ptr,  # [T, H] new residual out, D (may be x_ptr: each row is copied out before it is written)
    y_ptr,  # [T, H] normed out, D (any pointer unless WRITE_NORMED)
    q_ptr,  # uint8 codes (any pointer when QUANT == 0)
    sf_ptr,  # scales out (any pointer when the format has none)
    peers_ptr,  # int64 [WORLD]: every rank's workspace address
    epochs_ptr,  # int32 [SLOTS]: this rank's call counter per program
    err_ptr,  # int32 [1]: timeout bits
    n_rows,  # T
    x_stride,
    res_stride,
    h_stride,
    eps,
    weight_offset,
    rank,
    in_off,  # byte offset of the inputs region in every workspace
    sum_off,  # byte offset of the sums region (two-shot)
    spin_limit,  # polls before a wait gives up
    two_shot,  # 0: one-shot, 1: two-shot (runtime flags: one compiled kernel serves every call)
    copy_in,  # 1: copy x into this rank's inputs region; 0: x is that region (zero-copy)
    end_wait,  # 1: wait until every peer is done reading before exiting (an input buffer is lent)
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    VEC: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    SOFT: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    WORLD: tl.constexpr,
    SLOTS: tl.constexpr,  # rows map to programs as t % SLOTS; the flags' second axis
    SYNC: tl.constexpr,  # False: no flag operations (emulated ranks in one process)
    STAGE: tl.constexpr,  # 0: everything; 1, 2, 3: only that part (emulation)
):
    """Program ``b`` serves rows ``b, b + SLOTS, ...`` below T (the grid is ``min(T, SLOTS)``),
    and zeroes its share of the swizzled padding rows."""
    b = tl.program_id(0)
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    offs, mask = row_offsets(HIDDEN, BLOCK, GROUP, VEC)
    e = tl.load(epochs_ptr + b).to(tl.uint32, bitcast=True) + 1

    # Part 1: publish this rank's rows, then wait for every rank's.
    if STAGE == 0 or STAGE == 1:
        if copy_in != 0:
            if SYNC:  # noqa: SIM102 (a constexpr and a runtime test: Triton folds the first away)
                if end_wait == 0:  # else the previous call already waited at its end
                    _wait(peers_ptr, DONE, b, rank, e - 1, spin_limit, err_ptr, SLOTS, WORLD)
            mine = _region(peers_ptr, rank, in_off, DTYPE)
            for row in range(b, n_rows, SLOTS):
                row64 = tl.cast(row, tl.int64)
                x = tl.load(x_ptr + row64 * x_stride + offs, mask=mask)
                tl.store(mine + row64 * HIDDEN + offs, x, mask=mask)
        if SYNC:
            _signal(peers_ptr, READY, b, rank, e, SLOTS, WORLD)
            _wait(peers_ptr, READY, b, rank, e, spin_limit, err_ptr, SLOTS, WORLD)

    if two_shot == 0:
        # Part 2 (one-shot): every rank sums every partial of its rows, identically.
        if STAGE == 0 or STAGE == 2:
            for row in range(b, n_rows, SLOTS):
                row64 = tl.cast(row, tl.int64)
                s = _rank_order_sum(peers_ptr, in_off, row64, offs, mask, HIDDEN, WORLD, DTYPE, SOFT)
                norm_quant_epilogue(s, row64, res_ptr, res_stride, h_ptr, h_stride, w_ptr, scale_ptr, y_ptr,
                                    q_ptr, sf_ptr, eps, weight_offset, HIDDEN, BLOCK, GROUP, VEC, QUANT,
                                    SWIZZLED, WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT, SOFT_FP8)  # fmt: skip
    else:
        # Part 2 (two-shot): reduce the rows of this program that this rank owns, owner(t) =
        # (t % SLOTS + t // SLOTS) % WORLD: the j-th row of program b (t = b + j * SLOTS) belongs
        # to rank (b + j) % WORLD, so this rank's are j = first, first + WORLD, ...
        if STAGE == 0 or STAGE == 2:
            first = (rank - b % WORLD + WORLD) % WORLD
            sums = _region(peers_ptr, rank, sum_off, DTYPE)
            for row in range(b + first * SLOTS, n_rows, WORLD * SLOTS):
                row64 = tl.cast(row, tl.int64)
                s = _rank_order_sum(peers_ptr, in_off, row64, offs, mask, HIDDEN, WORLD, DTYPE, SOFT)
                tl.store(sums + row64 * HIDDEN + offs, to_dtype_rne(s, DTYPE, SOFT), mask=mask)
            if SYNC:
                _signal(peers_ptr, SUMS, b, rank, e, SLOTS, WORLD)
                _wait(peers_ptr, SUMS, b, rank, e, spin_limit, err_ptr, SLOTS, WORLD)
        # Part 3 (two-shot): every row's sum from its owner, then the epilogue.
        if STAGE == 0 or STAGE == 3:
            for row in range(b, n_rows, SLOTS):
                row64 = tl.cast(row, tl.int64)
                owner = (b + row // SLOTS) % WORLD
                v = tl.load(_region(peers_ptr, owner, sum_off, DTYPE) + row64 * HIDDEN + offs, mask=mask,
                            other=0.0)  # fmt: skip
                norm_quant_epilogue(to_fp32(v, SOFT), row64, res_ptr, res_stride, h_ptr, h_stride, w_ptr,
                                    scale_ptr, y_ptr, q_ptr, sf_ptr, eps, weight_offset, HIDDEN, BLOCK,
                                    GROUP, VEC, QUANT, SWIZZLED, WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT,
                                    SOFT_FP8)  # fmt: skip

    # Last part: release the peers' rows, pad the swizzled scales, count the call.
    if STAGE == 0 or STAGE == 3:
        if SYNC:
            _signal(peers_ptr, DONE, b, rank, e, SLOTS, WORLD)
            if end_wait != 0:
                _wait(peers_ptr, DONE, b, rank, e, spin_limit, err_ptr, SLOTS, WORLD)
        if SWIZZLED:
            pad_programs = (
                (n_rows + 127) // 128 * 128 - n_rows + PAD_ROWS_PER_PROGRAM - 1
            ) // PAD_ROWS_PER_PROGRAM
            for p in range(b, pad_programs, tl.num_programs(0)):
                zero_padding_rows(sf_ptr, p, n_rows, HIDDEN, BLOCK, GROUP)
        tl.store(epochs_ptr + b, e.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["rank", "spin_limit"])
def symm_wait_done_kernel(peers_ptr, epochs_ptr, err_ptr, rank, spin_limit, SLOTS: tl.constexpr,
                          WORLD: tl.constexpr):  # fmt: skip
    """Wait until every peer's program ``b`` is done reading this rank's rows of its last call
    (grid ``SLOTS``): run once when zero-copy input starts, so the caller's first write into the
    inputs region cannot race a peer still reading a copy-in call that did not wait at its end."""
    b = tl.program_id(0)
    e = tl.load(epochs_ptr + b).to(tl.uint32, bitcast=True)
    _wait(peers_ptr, DONE, b, rank, e, spin_limit, err_ptr, SLOTS, WORLD)
