"""The ``triton_symm`` kernels: the all-reduce over symmetric memory, then ``triton``'s epilogue.

Rows map to programs as ``b = t % SLOTS`` in every call (``SLOTS`` fixed per op), and every
access to row ``t`` of any rank's buffer is made by program ``b`` of some rank. So the ranks only
ever need to agree per program: program ``b`` of each rank synchronizes with program ``b`` of
every other rank through flags, never with the rest of the grid (docs/triton-symm.md).

Per call, program ``b`` has an epoch ``e`` (its call counter, ``epochs[b] + 1``; equal on every
rank because every rank runs the same calls with the same grid).

Push one-shot (``push``, decode sizes: ``T <= push_cap``), program ``b`` of rank ``me``: store each
of its rows into slot ``(e % 2, me)`` of every peer's push region; look at its own slots
``(e % 2, src)`` of those rows until no element holds the sentinel (every bit set, a NaN no
pushed element has: :func:`_publishable`), sum them in rank order, write the sentinel back, run
the epilogue. No flag and no fence: each element says itself whether it has arrived. A slot is
written again two calls later, by a peer that has seen this rank's next call, which this rank
starts only after the current one completed (stream order; with PDL, ``gdc_wait`` comes first).

The flag protocol (larger T, and zero-copy input). Flags hold epochs, only ever increase (mod
2**32) and are never reset, so they survive any number of CUDA-graph replays:

- ``signal(kind)``: ``__syncthreads``, then one release store of ``e`` at system scope into
  flag ``(kind, b, me)`` of every peer's buffer.
- ``wait(kind, target)``: acquire-poll this rank's flags ``(kind, b, src)`` for every peer
  ``src`` until each is at least ``target`` (wrap-safe compare), then ``__syncthreads``.

One-shot, program ``b``:

1. (copy-in) wait DONE >= the epoch of this program's last flag call (``epochs[SLOTS + b]``:
   every peer has finished reading this buffer's rows), copy this rank's rows into its inputs
   region; signal READY; wait READY >= e.
2. for each row: ``s = D(sum_r fp32(inputs_r[t]))`` from rank 0 up; the epilogue.
3. signal DONE; with ``end_wait`` (zero-copy input in use) wait DONE >= e before exiting, so the
   next writer of the inputs region (the caller's GEMM) cannot overwrite rows a peer still reads.

Two-shot: 1 as above; 2: this rank reduces the rows of program ``b`` that it owns
(``owner(t) = (t % SLOTS + t // SLOTS) % W``) into its sums region, signal SUMS, wait SUMS >= e;
3: every row's ``s`` from its owner's sums region, the epilogue; then DONE as above.

``SYNC=False`` compiles every flag operation and poll out and ``STAGE`` runs one part only (1:
publish or push, 2: one-shot sums and epilogue or two-shot reduction, 3: two-shot epilogue and the
call's end): the CPU tests run each emulated rank's stage 1, then each rank's stage 2, then stage
3, which is exactly the order the protocol enforces. ``STAGE=0`` runs the whole kernel. Push, the
kind (one-/two-shot), copy-in and end-wait are runtime flags, so one compiled kernel serves every
call of an op.
"""

from __future__ import annotations

import triton
import triton.language as tl

from arnorm_triton._casts import to_dtype_rne, to_fp32
from arnorm_triton._kernels import (
    epilogue_operands,
    norm_quant_apply,
    norm_quant_epilogue,
    row_offsets,
    zero_padding_rows,
)

__all__ = ["DONE", "PEER_ARGS", "READY", "SUMS", "symm_allreduce_norm_kernel", "symm_wait_done_kernel"]

#: Scalar arguments ``peer0 .. peer7`` carry every rank's workspace address (0 past the world size),
#: so a push store needs no load of the peer table first: the most ranks a kernel serves.
PEER_ARGS = 8

#: Flag kinds (the first axis of the flags region).
READY = tl.constexpr(0)
SUMS = tl.constexpr(1)
DONE = tl.constexpr(2)


@triton.jit
def _flag_ptr(base, kind, b, src, SLOTS: tl.constexpr, WORLD: tl.constexpr):
    """Flag ``(kind, b, src)`` in the buffer at integer address ``base`` (flags start at offset 0);
    ``src`` and ``base`` may be vectors (one flag per element)."""
    return (base + ((kind * SLOTS + b) * WORLD + src) * 4).to(tl.pointer_type(tl.uint32))


@triton.jit
def _behind(v, target):
    """``v < target`` on the epoch circle (uint32, wrap-safe while the two are < 2**31 apart)."""
    return ((v - target) >> 31) != 0


@triton.jit
def _peer_lanes(rank, WORLD: tl.constexpr):
    """``(src, others)``: one lane per rank (``WORLD`` rounded up to a power of two) and which
    lanes are peers. This rank's own flags are never written nor read: a program reads its own
    partial from registers or after its own barrier, so no flag is needed for it."""
    WP: tl.constexpr = triton.next_power_of_2(WORLD)
    src = tl.arange(0, WP)
    return src, (src < WORLD) & (src != rank)


@triton.jit
def _signal(peers_ptr, kind, b, rank, e, SLOTS: tl.constexpr, WORLD: tl.constexpr):
    # Every thread's memory accesses so far (the rows just written or read) happen before the
    # release below: the barrier orders them before thread-level releases (cumulativity).
    tl.debug_barrier()
    if WORLD > 1:
        src, others = _peer_lanes(rank, WORLD)
        # Every peer's address and one release per peer, all at once (one lane each).
        bases = tl.load(peers_ptr + src, mask=others, other=0)
        value = tl.full(src.shape, 0, tl.uint32) + e
        tl.atomic_xchg(_flag_ptr(bases, kind, b, rank, SLOTS, WORLD), value, mask=others, sem="release",
                       scope="sys")  # fmt: skip


@triton.jit
def _wait(my_base, kind, b, rank, target, spin_limit, err_ptr, SLOTS: tl.constexpr, WORLD: tl.constexpr):
    if WORLD > 1:
        src, others = _peer_lanes(rank, WORLD)
        # This rank's flags (kind, b, src) for every peer src, polled together: one acquire per
        # lane per round, until no peer is behind or the spin limit is reached.
        flags = _flag_ptr(my_base, kind, b, src, SLOTS, WORLD)
        v = tl.atomic_add(flags, 0, mask=others, sem="acquire", scope="sys")
        behind = tl.max((_behind(v, target) & others).to(tl.int32), axis=0)
        n = tl.full([], 0, tl.int32)
        while (behind != 0) & (n < spin_limit):
            v = tl.atomic_add(flags, 0, mask=others, sem="acquire", scope="sys")
            behind = tl.max((_behind(v, target) & others).to(tl.int32), axis=0)
            n += 1
        if behind != 0:
            # A peer never came: record it (TritonSymmBackend.check raises) rather than hang.
            tl.atomic_or(err_ptr, tl.full([], 1, tl.int32) << kind, sem="relaxed", scope="gpu")
    # Every thread's loads of peer rows happen after the acquire above.
    tl.debug_barrier()


@triton.jit
def _region(peers_ptr, p, offset, DTYPE: tl.constexpr):
    """Rank ``p``'s region at byte ``offset`` as a pointer to ``DTYPE`` (16-byte aligned)."""
    return tl.multiple_of((tl.load(peers_ptr + p) + offset).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def _rank_order_sum(peers_ptr, in_off, row64, offs, mask, mine, use_mine, rank, HIDDEN: tl.constexpr,
                    WORLD: tl.constexpr, DTYPE: tl.constexpr, SOFT: tl.constexpr):  # fmt: skip
    """``fp32(D(sum_r fp32(x_r[row])))``, accumulated in fp32 from rank 0 up (the reference's step 1;
    starting from rank 0's value, not 0.0, keeps a sum of negative zeros negative). With
    ``use_mine``, this rank's term is ``mine`` (the row in registers, exactly what its region holds)
    instead of a load from its own region."""
    own = use_mine & (rank == 0)
    x = tl.load(
        _region(peers_ptr, 0, in_off, DTYPE) + row64 * HIDDEN + offs, mask=mask & (own == 0), other=0.0
    )
    acc = to_fp32(tl.where(own, mine, x), SOFT)
    for p in tl.static_range(1, WORLD):
        own = use_mine & (rank == p)
        x = tl.load(_region(peers_ptr, p, in_off, DTYPE) + row64 * HIDDEN + offs, mask=mask & (own == 0),
                    other=0.0)  # fmt: skip
        acc = acc + to_fp32(tl.where(own, mine, x), SOFT)
    return to_fp32(to_dtype_rne(acc, DTYPE, SOFT), SOFT)


@triton.jit
def _bits(x, DTYPE: tl.constexpr):
    """``x``'s bits as a signed integer of its width (the sentinel is -1: every bit set)."""
    if DTYPE.primitive_bitwidth == 16:
        return x.to(tl.int16, bitcast=True)
    else:
        return x.to(tl.int32, bitcast=True)


@triton.jit
def _sentinel(offs, DTYPE: tl.constexpr):
    """The "not written yet" value of a push slot: every bit set (a NaN in bf16, fp16 and fp32)."""
    if DTYPE.primitive_bitwidth == 16:
        return tl.full(offs.shape, -1, tl.int16).to(DTYPE, bitcast=True)
    else:
        return tl.full(offs.shape, -1, tl.int32).to(DTYPE, bitcast=True)


@triton.jit
def _publishable(x, DTYPE: tl.constexpr):
    """``x`` with the sentinel's bit pattern replaced by the NaN one below it: a pushed element is
    never mistaken for "not written yet". Only that one NaN's payload changes (a sum with a NaN is
    a NaN either way); every rank sums the replaced values, its own included, so all agree."""
    bits = _bits(x, DTYPE)
    return tl.where(bits == -1, (bits - 1).to(DTYPE, bitcast=True), x)


@triton.jit
def _peer_addr(p: tl.constexpr, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7):
    """Rank ``p``'s workspace address from the scalar arguments (``p`` is a compile-time rank)."""
    if p == 0:
        a = peer0
    elif p == 1:
        a = peer1
    elif p == 2:
        a = peer2
    elif p == 3:
        a = peer3
    elif p == 4:
        a = peer4
    elif p == 5:
        a = peer5
    elif p == 6:
        a = peer6
    else:
        a = peer7
    return a


@triton.jit
def _own_row(x_ptr, x_stride, row64, first, mine, offs, mask, DTYPE: tl.constexpr):
    """This rank's row ``row64`` as it is pushed and summed (:func:`_publishable`): from registers
    (``mine``) when it is the program's ``first`` row, else loaded from ``x``."""
    if first:
        x = mine
    else:
        x = tl.load(x_ptr + row64 * x_stride + offs, mask=mask, other=0.0)
    return _publishable(x, DTYPE)


@triton.jit
def _epilogue(s, row64, first, res0, w0, scale0, res_ptr, res_stride, h_ptr, h_stride, w_ptr, scale_ptr,
              y_ptr, q_ptr, sf_ptr, eps, weight_offset, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
              GROUP: tl.constexpr, VEC: tl.constexpr, QUANT: tl.constexpr, SWIZZLED: tl.constexpr,
              WRITE_NORMED: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, SOFT: tl.constexpr,
              SOFT_FP8: tl.constexpr, PRELOAD: tl.constexpr,
              NORMALIZE_UNROUNDED: tl.constexpr = False, SCALE_LAYOUT: tl.constexpr = 0,
              n_rows=1):  # fmt: skip
    """``triton``'s epilogue for row ``row64`` from its sum ``s``. With ``PRELOAD`` its operands were
    loaded at the kernel's start (:func:`~arnorm_triton._kernels.epilogue_operands`: ``w0``,
    ``scale0``, and ``res0`` when this is the program's ``first`` row); else they are loaded now."""
    if PRELOAD:
        if first:
            res = res0
        else:
            offs, mask = row_offsets(HIDDEN, BLOCK, VEC)
            res = tl.load(res_ptr + row64 * res_stride + offs, mask=mask, other=0.0)
        norm_quant_apply(s, res, w0, scale0, row64, h_ptr, h_stride, y_ptr, q_ptr, sf_ptr, eps, weight_offset,
                         HIDDEN, BLOCK, GROUP, VEC, QUANT, SWIZZLED, WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT,
                         SOFT_FP8, True, NORMALIZE_UNROUNDED, SCALE_LAYOUT, n_rows)  # fmt: skip
    else:
        norm_quant_epilogue(s, row64, res_ptr, res_stride, h_ptr, h_stride, w_ptr, scale_ptr, y_ptr, q_ptr,
                            sf_ptr, eps, weight_offset, HIDDEN, BLOCK, GROUP, VEC, QUANT, SWIZZLED,
                            WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT, SOFT_FP8, True,
                            NORMALIZE_UNROUNDED, SCALE_LAYOUT, n_rows)  # fmt: skip


@triton.jit
def _push_slot(base, push_off, k, src, row64, push_cap, HIDDEN: tl.constexpr, WORLD: tl.constexpr,
               DTYPE: tl.constexpr):  # fmt: skip
    """Row ``row64`` of slot ``(k, src)`` of the push region of the buffer at integer ``base``:
    ``[2, WORLD, push_cap, HIDDEN]`` elements of ``DTYPE`` from byte ``push_off``."""
    start = tl.multiple_of((base + push_off).to(tl.pointer_type(DTYPE)), 16)
    return start + ((k * WORLD + src) * push_cap + row64) * HIDDEN


@triton.jit
def _push_pass(my_base, push_off, k, row64, push_cap, offs, mask, mine, rank, HIDDEN: tl.constexpr,
               BLOCK: tl.constexpr, WORLD: tl.constexpr, DTYPE: tl.constexpr, SOFT: tl.constexpr,
               VOLATILE: tl.constexpr):  # fmt: skip
    """One look at this rank's push slots of row ``row64``: ``(s, missing)`` with ``s`` the
    rank-order fp32 sum rounded once (as :func:`_rank_order_sum`; this rank's term is ``mine``) and
    ``missing`` nonzero while some peer's element still holds the sentinel. Every peer's row is
    loaded at once (one round trip per look, however many peers)."""
    missing = offs < 0
    acc = tl.zeros(offs.shape, tl.float32)
    for p in tl.static_range(WORLD):
        own = rank == p
        x = tl.load(_push_slot(my_base, push_off, k, p, row64, push_cap, HIDDEN, WORLD, DTYPE) + offs,
                    mask=mask & (own == 0), other=0.0, volatile=VOLATILE)  # fmt: skip
        missing = missing | ((_bits(x, DTYPE) == -1) & mask)
        x = tl.where(own, mine, x)
        if p == 0:
            acc = to_fp32(x, SOFT)
        else:
            acc = acc + to_fp32(x, SOFT)
    s = to_fp32(to_dtype_rne(acc, DTYPE, SOFT), SOFT)
    return s, tl.max(tl.reshape(missing.to(tl.int32), [BLOCK], can_reorder=True), axis=0)


@triton.jit(
    do_not_specialize=["n_rows", "rank", "spin_limit", "push_cap", "push", "two_shot", "copy_in", "end_wait"],
    do_not_specialize_on_alignment=["scale_ptr"],
)
def symm_allreduce_norm_kernel(
    x_ptr,  # [T, H] this rank's partial (row stride x_stride); its inputs region when not copy_in
    res_ptr,  # [T, H] residual in D
    w_ptr,  # [H] norm weight in D
    scale_ptr,  # fp32 [1]: fp8_static dequant scale / nvfp4 global encode scale (else any pointer)
    h_ptr,  # [T, H] new residual out, D (may be x_ptr: each row is read before it is written)
    y_ptr,  # [T, H] normed out, D (any pointer unless WRITE_NORMED)
    q_ptr,  # uint8 codes (any pointer when QUANT == 0)
    sf_ptr,  # scales out (any pointer when the format has none)
    peers_ptr,  # int64 [WORLD]: every rank's workspace address
    epochs_ptr,  # int32 [2, SLOTS]: this rank's call counter per program, then its last flag call's
    err_ptr,  # int32 [1]: timeout bits
    my_base,  # this rank's workspace address (peers[rank]), so polls need no load first
    peer0,  # peer0 .. peer7: every rank's workspace address (peers[r]; 0 past WORLD), as scalars
    peer1,
    peer2,
    peer3,
    peer4,
    peer5,
    peer6,
    peer7,
    n_rows,  # T
    x_stride,
    res_stride,
    h_stride,
    eps,
    weight_offset,
    rank,
    in_off,  # byte offset of the inputs region in every workspace
    sum_off,  # byte offset of the sums region (two-shot)
    push_off,  # byte offset of the push region [2, WORLD, push_cap, H]
    push_cap,  # rows per push slot
    spin_limit,  # polls before a wait gives up
    push,  # 1: one-shot by push (no flags; T <= push_cap); 0: the flag protocol
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
    SYNC: tl.constexpr,  # False: no flag operations and no polling (emulated ranks in one process)
    STAGE: tl.constexpr,  # 0: everything; 1, 2, 3: only that part (emulation)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (CUDA SM 9.0+, launched with launch_pdl)
    NORMALIZE_UNROUNDED: tl.constexpr = False,  # the norm reads fp32(s) + fp32(res), not fp32(h)
    SCALE_LAYOUT: tl.constexpr = 0,  # the per-group fp8 formats' scale layout (_kernels.SCALE_LAYOUT_CODES)
):
    """Programs ``b < min(T, SLOTS)`` serve rows ``b, b + SLOTS, ...`` below T; with swizzled
    scales, :func:`~arnorm_triton._kernels.padding_programs` more programs zero the padding rows
    and take no part in the protocol (the grid is a function of T alone on every rank).

    With ``USE_PDL`` every program waits for the preceding grid (``griddepcontrol.wait``) before its
    first load and before any peer can learn of this call, so a peer that sees this call knows
    that this rank's previous call has completed (the push protocol's slot reuse relies on it)."""
    b = tl.program_id(0)
    n_main = tl.minimum(n_rows, SLOTS)
    if SWIZZLED:  # noqa: SIM102
        if b >= n_main:
            # A padding program: it touches no symmetric memory, no flag and no call counter,
            # so it needs no synchronization and runs beside the row programs, not after them.
            if STAGE == 0 or STAGE == 3:
                if USE_PDL:  # the preceding grid may still read the scales these programs overwrite
                    tl.extra.cuda.gdc_wait()
                zero_padding_rows(sf_ptr, b - n_main, n_rows, HIDDEN, BLOCK, GROUP)
            return
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    offs, mask = row_offsets(HIDDEN, BLOCK, VEC)
    b64 = tl.cast(b, tl.int64)
    if USE_PDL:  # the addresses above need nothing from the preceding grid; everything below does
        tl.extra.cuda.gdc_wait()
    e = tl.load(epochs_ptr + b).to(tl.uint32, bitcast=True) + 1
    # This rank's first row, loaded before any wait (it is this rank's own data either way): it
    # is published from registers and summed from registers.
    mine = tl.load(x_ptr + b64 * x_stride + offs, mask=mask, other=0.0)
    # At world size 2 and rows of up to 4096 lanes (8 warps), so are the epilogue's loads of that
    # row (residual, weight, scale): made now, they overlap the publish and the wait instead of
    # following them (the weight and scale serve every row). Measured on the H200 (kernel-variants
    # runs 7-9): 3-8% faster at H 4096, T <= 128; 4-5% slower at H 8192 (16 warps, where ptxas is near
    # its 128-register cap), and slower at world size 1, where there is no wait to hide them in. At
    # larger world sizes a poll holds every peer's row and the held operands make ptxas spill.
    PRELOAD: tl.constexpr = WORLD == 2 and BLOCK <= 4096
    if PRELOAD:
        res0, w0, scale0 = epilogue_operands(b64, res_ptr, res_stride, w_ptr, scale_ptr, HIDDEN, BLOCK, GROUP,
                                             VEC, QUANT)  # fmt: skip
    else:  # unused
        res0, w0, scale0 = mine, mine, 1.0

    if push != 0:
        # One-shot by push: rank r stores its rows into slot (e % 2, r) of every peer's push region;
        # each rank polls its own slots until no element is the sentinel, sums, then puts the
        # sentinel back. No flag, no fence: the data says it has arrived (docs/triton-symm.md).
        k = (e & 1).to(tl.int64)
        if (STAGE == 0 or STAGE == 1) and WORLD > 1:
            for row in range(b, n_rows, SLOTS):
                row64 = tl.cast(row, tl.int64)
                x = _own_row(x_ptr, x_stride, row64, row == b, mine, offs, mask, DTYPE)
                for p in tl.static_range(WORLD):
                    peer = _peer_addr(p, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7)
                    dst = _push_slot(peer, push_off, k, rank, row64, push_cap, HIDDEN, WORLD, DTYPE)
                    tl.store(dst + offs, x, mask=mask & (rank != p))
        if STAGE == 0 or STAGE == 2:
            for row in range(b, n_rows, SLOTS):
                row64 = tl.cast(row, tl.int64)
                x = _own_row(x_ptr, x_stride, row64, row == b, mine, offs, mask, DTYPE)
                s, missing = _push_pass(my_base, push_off, k, row64, push_cap, offs, mask, x, rank, HIDDEN,
                                        BLOCK, WORLD, DTYPE, SOFT, SYNC)  # fmt: skip
                if SYNC and WORLD > 1:  # at world size 1 nothing is pushed: no look is needed
                    n = tl.full([], 0, tl.int32)
                    while (missing != 0) & (n < spin_limit):
                        s, missing = _push_pass(my_base, push_off, k, row64, push_cap, offs, mask, x, rank,
                                                HIDDEN, BLOCK, WORLD, DTYPE, SOFT, SYNC)  # fmt: skip
                        n += 1
                    if missing != 0:  # a peer never came: record it rather than hang
                        tl.atomic_or(err_ptr, tl.full([], 8, tl.int32), sem="relaxed", scope="gpu")
                # Read: the slots take the sentinel again for the call after next (slot e % 2).
                if WORLD > 1:
                    for p in tl.static_range(WORLD):
                        dst = _push_slot(my_base, push_off, k, p, row64, push_cap, HIDDEN, WORLD, DTYPE)
                        tl.store(dst + offs, _sentinel(offs, DTYPE), mask=mask & (rank != p))
                _epilogue(s, row64, row == b, res0, w0, scale0, res_ptr, res_stride, h_ptr, h_stride, w_ptr,
                          scale_ptr, y_ptr, q_ptr, sf_ptr, eps, weight_offset, HIDDEN, BLOCK, GROUP, VEC,
                          QUANT, SWIZZLED, WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT, SOFT_FP8,
                          PRELOAD, NORMALIZE_UNROUNDED, SCALE_LAYOUT, n_rows)  # fmt: skip
    else:
        _flag_call(x_ptr, res_ptr, w_ptr, scale_ptr, h_ptr, y_ptr, q_ptr, sf_ptr, peers_ptr, epochs_ptr,
                   err_ptr, my_base, n_rows, x_stride, res_stride, h_stride, eps, weight_offset, rank, in_off,
                   sum_off, spin_limit, two_shot, copy_in, end_wait, b, b64, e, mine, res0, w0, scale0, offs,
                   mask, HIDDEN, BLOCK, GROUP, VEC, QUANT, SWIZZLED, WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT,
                   SOFT_FP8, WORLD, SLOTS, SYNC, STAGE, PRELOAD, NORMALIZE_UNROUNDED,
                   SCALE_LAYOUT)  # fmt: skip

    # Last part: count the call.
    if STAGE == 0 or STAGE == 3:
        tl.store(epochs_ptr + b, e.to(tl.int32, bitcast=True))
        if push == 0:
            tl.store(epochs_ptr + SLOTS + b, e.to(tl.int32, bitcast=True))
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _flag_call(x_ptr, res_ptr, w_ptr, scale_ptr, h_ptr, y_ptr, q_ptr, sf_ptr, peers_ptr, epochs_ptr, err_ptr,
               my_base, n_rows, x_stride, res_stride, h_stride, eps, weight_offset, rank, in_off, sum_off,
               spin_limit, two_shot, copy_in, end_wait, b, b64, e, mine, res0, w0, scale0, offs, mask,
               HIDDEN: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, VEC: tl.constexpr,
               QUANT: tl.constexpr, SWIZZLED: tl.constexpr, WRITE_NORMED: tl.constexpr,
               ROUND_BEFORE_WEIGHT: tl.constexpr, SOFT: tl.constexpr, SOFT_FP8: tl.constexpr,
               WORLD: tl.constexpr, SLOTS: tl.constexpr, SYNC: tl.constexpr, STAGE: tl.constexpr,
               PRELOAD: tl.constexpr, NORMALIZE_UNROUNDED: tl.constexpr,
               SCALE_LAYOUT: tl.constexpr):  # fmt: skip
    """One call of program ``b`` through the flag protocol (one-shot or two-shot; the module's
    docstring); ``res0, w0, scale0``: the epilogue's operands of row ``b`` when ``PRELOAD``.
    ``DONE`` is signalled by flag calls only, so the copy-in waits for the peers' ``DONE`` of this
    rank's last flag call (``epochs[SLOTS + b]``), not of the previous call."""
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    # Part 1: publish this rank's rows, then wait for every rank's.
    if STAGE == 0 or STAGE == 1:
        if copy_in != 0:
            if SYNC:  # noqa: SIM102 (a constexpr and a runtime test: Triton folds the first away)
                if end_wait == 0:  # else the previous flag call already waited at its end
                    last = tl.load(epochs_ptr + SLOTS + b).to(tl.uint32, bitcast=True)
                    _wait(my_base, DONE, b, rank, last, spin_limit, err_ptr, SLOTS, WORLD)
            region = _region(peers_ptr, rank, in_off, DTYPE)
            tl.store(region + b64 * HIDDEN + offs, mine, mask=mask)
            for row in range(b + SLOTS, n_rows, SLOTS):
                row64 = tl.cast(row, tl.int64)
                x = tl.load(x_ptr + row64 * x_stride + offs, mask=mask)
                tl.store(region + row64 * HIDDEN + offs, x, mask=mask)
        if SYNC:
            _signal(peers_ptr, READY, b, rank, e, SLOTS, WORLD)
            _wait(my_base, READY, b, rank, e, spin_limit, err_ptr, SLOTS, WORLD)
    if two_shot == 0:
        # Part 2 (one-shot): every rank sums every partial of its rows, identically.
        if STAGE == 0 or STAGE == 2:
            s = _rank_order_sum(peers_ptr, in_off, b64, offs, mask, mine, True, rank, HIDDEN, WORLD, DTYPE,
                                SOFT)  # fmt: skip
            if SYNC:  # noqa: SIM102
                if n_rows <= SLOTS:
                    # This program's only row is read: release the peers' rows before the epilogue.
                    _signal(peers_ptr, DONE, b, rank, e, SLOTS, WORLD)
            _epilogue(s, b64, True, res0, w0, scale0, res_ptr, res_stride, h_ptr, h_stride, w_ptr, scale_ptr,
                      y_ptr, q_ptr, sf_ptr, eps, weight_offset, HIDDEN, BLOCK, GROUP, VEC, QUANT, SWIZZLED,
                      WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT, SOFT_FP8, PRELOAD,
                      NORMALIZE_UNROUNDED, SCALE_LAYOUT, n_rows)  # fmt: skip
            for row in range(b + SLOTS, n_rows, SLOTS):
                row64 = tl.cast(row, tl.int64)
                s = _rank_order_sum(peers_ptr, in_off, row64, offs, mask, mine, False, rank, HIDDEN, WORLD,
                                    DTYPE, SOFT)  # fmt: skip
                _epilogue(s, row64, False, res0, w0, scale0, res_ptr, res_stride, h_ptr, h_stride, w_ptr,
                          scale_ptr, y_ptr, q_ptr, sf_ptr, eps, weight_offset, HIDDEN, BLOCK, GROUP, VEC,
                          QUANT, SWIZZLED, WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT, SOFT_FP8,
                          PRELOAD, NORMALIZE_UNROUNDED, SCALE_LAYOUT, n_rows)  # fmt: skip
        if (STAGE == 0 or STAGE == 3) and SYNC:  # noqa: SIM102
            if n_rows > SLOTS:  # several rows per program: all of them are read now
                _signal(peers_ptr, DONE, b, rank, e, SLOTS, WORLD)
    else:
        # Part 2 (two-shot): reduce the rows of this program that this rank owns, owner(t) =
        # (t % SLOTS + t // SLOTS) % WORLD: the j-th row of program b (t = b + j * SLOTS) belongs
        # to rank (b + j) % WORLD, so this rank's are j = first, first + WORLD, ...
        if STAGE == 0 or STAGE == 2:
            first = (rank - b % WORLD + WORLD) % WORLD
            sums = _region(peers_ptr, rank, sum_off, DTYPE)
            for row in range(b + first * SLOTS, n_rows, WORLD * SLOTS):
                row64 = tl.cast(row, tl.int64)
                s = _rank_order_sum(peers_ptr, in_off, row64, offs, mask, mine, row == b, rank, HIDDEN, WORLD,
                                    DTYPE, SOFT)  # fmt: skip
                tl.store(sums + row64 * HIDDEN + offs, to_dtype_rne(s, DTYPE, SOFT), mask=mask)
            if SYNC:
                _signal(peers_ptr, SUMS, b, rank, e, SLOTS, WORLD)
                _wait(my_base, SUMS, b, rank, e, spin_limit, err_ptr, SLOTS, WORLD)
        # Part 3 (two-shot): every row's sum from its owner, then the epilogue.
        if STAGE == 0 or STAGE == 3:
            for row in range(b, n_rows, SLOTS):
                row64 = tl.cast(row, tl.int64)
                owner = (b + row // SLOTS) % WORLD
                v = tl.load(_region(peers_ptr, owner, sum_off, DTYPE) + row64 * HIDDEN + offs, mask=mask,
                            other=0.0)  # fmt: skip
                _epilogue(to_fp32(v, SOFT), row64, row == b, res0, w0, scale0, res_ptr, res_stride, h_ptr,
                          h_stride, w_ptr, scale_ptr, y_ptr, q_ptr, sf_ptr, eps, weight_offset, HIDDEN, BLOCK,
                          GROUP, VEC, QUANT, SWIZZLED, WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT, SOFT_FP8,
                          PRELOAD, NORMALIZE_UNROUNDED, SCALE_LAYOUT, n_rows)  # fmt: skip
            if SYNC:
                _signal(peers_ptr, DONE, b, rank, e, SLOTS, WORLD)

    # With an input buffer lent, wait until the peers are done reading.
    if (STAGE == 0 or STAGE == 3) and SYNC:  # noqa: SIM102
        if end_wait != 0:
            _wait(my_base, DONE, b, rank, e, spin_limit, err_ptr, SLOTS, WORLD)


@triton.jit(do_not_specialize=["rank", "spin_limit"])
def symm_wait_done_kernel(epochs_ptr, err_ptr, my_base, rank, spin_limit, SLOTS: tl.constexpr,
                          WORLD: tl.constexpr):  # fmt: skip
    """Wait until every peer's program ``b`` is done reading this rank's rows of its last flag call
    (grid ``SLOTS``): run once when zero-copy input starts, so the caller's first write into the
    inputs region cannot race a peer still reading a copy-in call that did not wait at its end.
    (Push calls never read a peer's inputs region.)"""
    b = tl.program_id(0)
    e = tl.load(epochs_ptr + SLOTS + b).to(tl.uint32, bitcast=True)
    _wait(my_base, DONE, b, rank, e, spin_limit, err_ptr, SLOTS, WORLD)
