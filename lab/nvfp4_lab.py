"""NVFP4 lab (issue 14, item 3): candidate rewrites of the nvfp4 part of the fused kernel, kept out
of ``arnorm_triton`` until one wins on the H200 (``lab/gpu_nvfp4_round.sh``).

``own_f`` won on 2026-12-03 (0.86-0.94 of copy bandwidth against production's 0.74-0.79,
``the nvfp4 lab results of 2026-12-03 (git history, commit 1cb64b8)``) and is now the production nvfp4 path
(whole blocks per thread, ``e2m1_code_fma``, packed words; since 2026-12-04 production stores
from a flat row layout instead, kernel-variants run 21). "production" below means the
kernel before that port; the lab's ``launch_production`` now runs the ported kernel, so the
``same_*`` variants' normed outputs may differ from it by 1 ulp, as ``own_f``'s did before.

Offline SASS of the production kernel (H = 4096, bf16, 8 warps, ptxas SM 9.0): 699 instructions
per thread on the row path (fp8_static: 454), i.e. 44 thread instructions per element against
28; at 16 elements per thread the nvfp4 part is about 17 per element for the e2m1 codes (integer
rounding, per-element NaN select, byte packing) and 6 per element for the per-block work (e4m3
decode in integer ops, two ``div_rn`` fast paths, done by both threads that share a block) and
a shared-memory round trip with two ``bar.sync`` for the 1-byte block-scale store. At 4.25 TB/s
an SM has about 7400 warp-issue slots per row at 0.9 of copy bandwidth; the kernel needs 5600.

Every knob below but ``OWN`` keeps every output bit for bit (checked against the production
kernel by ``tests/arnorm_triton/test_nvfp4_lab.py`` in the interpreter and by the GPU round):

- ``E2M1 = 1``: codes by one fused multiply-add: ``t = |v|c + 2**(e + 22)`` with
  ``|v|c = min(|v|, 6)`` and ``2**e = max(2**floor(log2 |v|c), 1)`` rounds ``|v|c`` to the e2m1
  grid of its binade (spacing 0.5 below 2, 1 in [2, 4), 2 in [4, 8)) with ties to even in the
  adder, and ``t``'s low bits count grid steps: ``code = bits(t) - bits(2**e) - (22 << 23) + 2e``.
  NaN codes are 0: with ``|scale| < 2**118`` the encode scale is finite, so a NaN ``v`` means a
  NaN block (NaN amax or scale: every ``v`` of the block is NaN) and the block's packed words are
  zeroed; other scales take the production per-element path (a uniform branch on a scalar).
- ``PACK = 1``: the 8 codes of a thread's 16-byte slice go out as one 32-bit word (shift + add,
  no byte permutes).
- ``DECODE_HW = 1``: the e4m3 block scale is decoded by the hardware ``cvt`` (fp8 -> f16 -> f32,
  exact) instead of integer bit arithmetic.
- ``SF_STORE = 1``: block scales and code words stored with offsets marked non-contiguous from
  a 2-D tile of the row layout, so Triton keeps the values' own layout (whole-block layouts: no
  shared-memory conversion and no barrier left; the production layout still converts the scales).
- ``AMAX_F = 1``: block amax by ``max.NaN.f32`` with the abs as an operand modifier (the integer
  abs-max's value up to the NaN payload, which nothing reads): one instruction per element.
- ``OWN = 1``: the row as ``[GROUP // VEC, NB, VEC]``, so Triton's layout gives each thread whole
  quantization blocks: block amax, scale, ``div_rn`` and packing need no shuffle and are not
  computed twice (the production layout splits a block over two lanes). Normed output within
  1 ulp (the sum of squares is associated differently); quantized output bitwise arnorm.quant's.
- ``ROWS``: rows per program (the weight is loaded and widened once).

Offline SASS, H = 4096, no normed output, main-path instructions per thread (warp-instructions
per row; thread instructions per element): production 8 warps 699 (5592; 43.7), 4 warps 1234
(4936; 38.6); same_f 8w 587 (4696; 36.7); own_f 8w 519 (4152; 32.4), 4w 935 (3740; 29.2);
own_f_r2 4w 1715 per 2 rows (3430; 26.8); own_f_r4 4w 2785 per 4 rows (2785; 21.8);
fp8_static 8w 454 (3632; 28.4), which reaches 0.92 of copy bandwidth.
"""

from __future__ import annotations

import triton
import triton.language as tl

from arnorm_triton import _kernels as K
from arnorm_triton._casts import abs_max, e2m1_code, e4m3_bits, e4m3_decode, to_dtype_rne, to_fp32
from arnorm_triton._kernels import padding_programs, row_shape

__all__ = ["VARIANTS", "grid_rows", "lab_kernel", "launch_lab", "launch_production"]

#: fp32(1/6) by its bits, as the production kernel.
_INV_E2M1_MAX = tl.constexpr(K._INV_E2M1_MAX.value)
#: |scale| below this keeps the encode scale finite (scale / sf with sf >= 2**-9): 2**118.
_FAST_SCALE_LIMIT = tl.constexpr(float(2**118))

#: name -> lab constexprs. "same_*" keep the production register layout (every output bitwise
#: today's); "own*" give each thread whole blocks (normed output within the contract's 1 ulp:
#: the fp32 sum of squares is associated differently, as a change of num_warps also does).
_BASE = {"E2M1": 0, "PACK": 0, "DECODE_HW": 0, "SF_STORE": 0, "OWN": 0, "AMAX_F": 0, "ROWS": 1}
_FAST = {"E2M1": 1, "DECODE_HW": 1, "PACK": 1, "SF_STORE": 1}
VARIANTS: dict[str, dict[str, int]] = {
    "lab_base": _BASE,  # the production kernel's code, rebuilt here (control)
    "fma": {**_BASE, "E2M1": 1},
    "fma_hw": {**_BASE, "E2M1": 1, "DECODE_HW": 1},
    "fma_hw_r2": {**_BASE, "E2M1": 1, "DECODE_HW": 1, "ROWS": 2},
    "fma_hw_pack": {**_BASE, **_FAST},
    "same_f": {**_BASE, **_FAST, "AMAX_F": 1},
    "same_f_r2": {**_BASE, **_FAST, "AMAX_F": 1, "ROWS": 2},
    "own": {**_BASE, **_FAST, "OWN": 1},
    "own_r2": {**_BASE, **_FAST, "OWN": 1, "ROWS": 2},
    "own_f": {**_BASE, **_FAST, "OWN": 1, "AMAX_F": 1},
    "own_f_r2": {**_BASE, **_FAST, "OWN": 1, "AMAX_F": 1, "ROWS": 2},
    "own_f_r4": {**_BASE, **_FAST, "OWN": 1, "AMAX_F": 1, "ROWS": 4},
}


@triton.jit
def e2m1_code_fma(v):
    """e2m1 code (int32, 0..15) of fp32 ``v`` for non-NaN ``v``: the same code as
    :func:`arnorm_triton._casts.e2m1_code` (RNE onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating,
    sign bit from ``v``); a NaN ``v`` gives an unspecified code (callers zero NaN blocks)."""
    a = tl.minimum(tl.abs(v), 6.0)
    e_bits = tl.maximum(a.to(tl.int32, bitcast=True), 0x3F800000) & 0x7F800000
    t = tl.fma(e_bits.to(tl.float32, bitcast=True), 4194304.0, a)
    code = t.to(tl.int32, bitcast=True) - e_bits + ((e_bits >> 22) - (254 + (22 << 23)))
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 0x8)


@triton.jit
def _pack_words(codes, VEC: tl.constexpr):
    """int32 codes ``[NB, G, VEC]`` (VEC = 8) -> int32 words ``[NB, G]``, element v in nibble v."""
    shifts = tl.arange(0, VEC) * 4
    return tl.sum(codes << shifts[None, None, :], axis=2)


@triton.jit
def _store_scales(sf_ptr, vals, blk, only, row64, K_: tl.constexpr, SWIZZLED: tl.constexpr):
    """As the production ``_store_block_scales``, from a 2-D tile in the row's own register layout
    (``vals``, ``blk`` broadcast to the tile of the packed words; ``only``: the one lane per block
    that stores) with offsets marked non-contiguous, so that Triton does not convert the values
    (through shared memory, two barriers) to a vector layout first."""
    if SWIZZLED:
        KP: tl.constexpr = (K_ + 3) // 4 * 4
        offs = tl.max_contiguous(K._swizzled_offset(row64, blk, KP), [1, 1])
        tl.store(sf_ptr + offs, tl.where(blk < K_, vals, 0).to(tl.uint8), mask=only & (blk < KP))
    else:
        offs = tl.max_contiguous(row64 * K_ + blk, [1, 1])
        tl.store(sf_ptr + offs, vals.to(tl.uint8), mask=only & (blk < K_))


@triton.jit
def _max_abs_nan(a, b):
    return tl.maximum(tl.abs(a), tl.abs(b), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block_amax(yf, axis0: tl.constexpr, axis1: tl.constexpr, AMAX_F: tl.constexpr):
    """Block amaxes over two axes, NaN if any element is NaN: :func:`abs_max` (integer max of the
    abs bits), or (``AMAX_F``) a float max with NaN propagation (``max.NaN.f32``, abs a free
    operand modifier): the same value up to the NaN payload, which no later step reads."""
    if AMAX_F:
        return tl.reduce(tl.reduce(yf, axis0, _max_abs_nan), axis1, _max_abs_nan)
    else:
        return abs_max(abs_max(yf, axis0), axis1)


@triton.jit
def _codes(v, enc_nan, scale, E2M1: tl.constexpr, MASK: tl.constexpr):
    """int32 e2m1 codes of ``v`` (production or single-FMA rounding); ``MASK``: zero the codes of
    NaN blocks here (``enc_nan`` broadcast to v), else the caller zeroes packed words."""
    if E2M1 == 1:
        if tl.abs(scale) < _FAST_SCALE_LIMIT:
            c = e2m1_code_fma(v)
            if MASK:
                c = tl.where(enc_nan, 0, c)
        else:
            c = e2m1_code(v).to(tl.int32)
    else:
        c = e2m1_code(v).to(tl.int32)
    return c


@triton.jit
def _nvfp4_row(yf, scale, row64, q_ptr, sf_ptr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
               GROUP: tl.constexpr,
               VEC: tl.constexpr, SWIZZLED: tl.constexpr, SOFT_FP8: tl.constexpr, E2M1: tl.constexpr,
               PACK: tl.constexpr, DECODE_HW: tl.constexpr, SF_STORE: tl.constexpr, OWN: tl.constexpr,
               AMAX_F: tl.constexpr):  # fmt: skip
    """Step 4 for nvfp4 of one row: ``yf`` fp32, D-rounded, ``[NB, GROUP // VEC, VEC]``
    (``OWN``: ``[GROUP // VEC, NB, VEC]``, a thread owns whole blocks)."""
    NB: tl.constexpr = BLOCK // GROUP
    G: tl.constexpr = GROUP // VEC
    K_: tl.constexpr = HIDDEN // GROUP
    blk = tl.arange(0, NB)
    if OWN:
        amax = _block_amax(yf, 2, 0, AMAX_F)
    else:
        amax = _block_amax(yf, 2, 1, AMAX_F)
    sf_code = e4m3_bits(scale * (amax * _INV_E2M1_MAX), SOFT_FP8)
    if DECODE_HW and not SOFT_FP8:
        sf = (sf_code & 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        sf = e4m3_decode(sf_code)
    enc = tl.where(sf == 0.0, 0.0, tl.div_rn(scale, tl.where(sf == 0.0, 1.0, sf)))
    if OWN:
        v = yf * enc[None, :, None]
        enc_nan = (enc != enc)[None, :, None]
        jj = tl.arange(0, G)[:, None]
        bb = blk[None, :]
    else:
        v = yf * enc[:, None, None]
        enc_nan = (enc != enc)[:, None, None]
        jj = tl.arange(0, G)[None, :]
        bb = blk[:, None]
    c = _codes(v, enc_nan, scale, E2M1, not PACK)
    qrow = q_ptr + row64 * (HIDDEN // 2)
    if PACK:
        tl.static_assert(VEC == 8, "PACK needs 8 elements per 16-byte slice (2-byte dtypes)")
        words = tl.sum(c << (tl.arange(0, VEC) * 4)[None, None, :], axis=2)
        if E2M1 == 1:  # NaN blocks (fast path only: the production path zeroes NaN codes itself)
            words = tl.where(tl.sum(enc_nan.to(tl.int32), axis=2) > 0, 0, words)
        woffs = bb * G + jj
        tl.store(qrow.to(tl.pointer_type(tl.int32)) + tl.max_contiguous(woffs, [1, 1]), words,
                 mask=woffs < HIDDEN // VEC)  # fmt: skip
    else:
        if OWN:
            lo, hi = tl.split(tl.reshape(c, [G, NB, VEC // 2, 2]))
        else:
            lo, hi = tl.split(tl.reshape(c, [NB, G, VEC // 2, 2]))
        poffs = (bb * (GROUP // 2) + jj * (VEC // 2))[:, :, None] + tl.arange(0, VEC // 2)[None, None, :]
        tl.store(qrow + poffs, (lo | (hi << 4)).to(tl.uint8), mask=poffs < HIDDEN // 2)
    if SF_STORE:
        if OWN:  # [1, NB]: one block per lane already
            _store_scales(sf_ptr, sf_code[None, :], bb, bb >= 0, row64, K_, SWIZZLED)
        else:  # [NB, G] like the words: lane j == 0 of each block stores
            zero = jj * 0
            _store_scales(
                sf_ptr, sf_code[:, None] + zero.to(tl.uint8), bb + zero, jj == 0, row64, K_, SWIZZLED
            )
    else:
        K._store_block_scales(sf_ptr, sf_code, row64, blk, K_, SWIZZLED)


@triton.jit
def _offsets(
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, VEC: tl.constexpr, OWN: tl.constexpr
):
    """Row offsets and mask as ``[NB, GROUP // VEC, VEC]`` (the production layout of 2026-12-03),
    or (``OWN``) the same offsets as ``[GROUP // VEC, NB, VEC]`` so that Triton gives each thread
    whole quantization blocks. (Production has since moved to :func:`row_offsets`' flat
    ``[BLOCK // VEC, VEC]``, kernel-variants run 21; this lab keeps the layouts it compared.)"""
    if OWN:
        offs = (
            tl.arange(0, GROUP // VEC)[:, None, None] * VEC
            + tl.arange(0, BLOCK // GROUP)[None, :, None] * GROUP
            + tl.arange(0, VEC)[None, None, :]
        )
    else:
        offs = (
            tl.arange(0, BLOCK // GROUP)[:, None, None] * GROUP
            + tl.arange(0, GROUP // VEC)[None, :, None] * VEC
            + tl.arange(0, VEC)[None, None, :]
        )
    return offs, offs < HIDDEN


@triton.jit(do_not_specialize=["n_rows"], do_not_specialize_on_alignment=["scale_ptr"])
def lab_kernel(
    x_ptr, res_ptr, w_ptr, scale_ptr, h_ptr, y_ptr, q_ptr, sf_ptr, n_rows, x_stride, res_stride, h_stride,
    eps, weight_offset,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, VEC: tl.constexpr, SWIZZLED: tl.constexpr,
    WRITE_NORMED: tl.constexpr, SOFT: tl.constexpr, SOFT_FP8: tl.constexpr, USE_PDL: tl.constexpr,
    E2M1: tl.constexpr, PACK: tl.constexpr, DECODE_HW: tl.constexpr, SF_STORE: tl.constexpr,
    OWN: tl.constexpr, AMAX_F: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """The production fused kernel for nvfp4 (one partial, a residual, weight after rounding
    order ``round_before_weight=False``), ``ROWS`` rows per program; programs past
    ``cdiv(T, ROWS)`` zero swizzled padding rows as the production kernel's extra programs do."""
    pid = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    n_progs = (n_rows + ROWS - 1) // ROWS
    if pid < n_progs:
        offs, mask = _offsets(HIDDEN, BLOCK, GROUP, VEC, OWN)
        w = to_fp32(tl.load(w_ptr + offs, mask=mask, other=0.0), SOFT) + weight_offset
        scale = tl.load(scale_ptr)
        for r in tl.static_range(ROWS):
            row = pid * ROWS + r
            if row < n_rows:
                row64 = row.to(tl.int64)
                s = to_fp32(tl.load(x_ptr + row64 * x_stride + offs, mask=mask, other=0.0), SOFT)
                res = tl.load(res_ptr + row64 * res_stride + offs, mask=mask, other=0.0)
                h = to_dtype_rne(s + to_fp32(res, SOFT), DTYPE, SOFT)
                tl.store(h_ptr + row64 * h_stride + offs, h, mask=mask)
                hf = to_fp32(h, SOFT)
                if OWN:  # in-thread axes first: one cross-lane reduction
                    ss = tl.sum(tl.sum(tl.sum(hf * hf, axis=2), axis=0), axis=0)
                else:  # the production kernel's order
                    ss = tl.sum(tl.sum(tl.sum(hf * hf, axis=2), axis=1), axis=0)
                mean_sq = tl.div_rn(ss, HIDDEN * 1.0)
                inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
                y = to_dtype_rne(hf * inv_rms * w, DTYPE, SOFT)
                if WRITE_NORMED:
                    tl.store(y_ptr + row64 * HIDDEN + offs, y, mask=mask)
                _nvfp4_row(to_fp32(y, SOFT), scale, row64, q_ptr, sf_ptr, HIDDEN, BLOCK, GROUP, VEC, SWIZZLED,
                           SOFT_FP8, E2M1, PACK, DECODE_HW, SF_STORE, OWN, AMAX_F)  # fmt: skip
    else:
        if SWIZZLED:
            K.zero_padding_rows(sf_ptr, pid - n_progs, n_rows, HIDDEN, BLOCK, GROUP)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def grid_rows(n_rows: int, rows: int, swizzled: bool) -> int:
    """Programs for ``n_rows`` rows at ``rows`` rows per program (+ swizzled padding programs)."""
    return (n_rows + rows - 1) // rows + (padding_programs(n_rows) if swizzled else 0)


def launch_lab(
    variant: str,
    x,
    res,
    w,
    scale,
    h,
    y,
    q,
    sf,
    *,
    eps: float,
    weight_offset: float,
    swizzled: bool,
    num_warps: int,
    soft: bool = False,
    soft_fp8: bool = False,
    pdl: bool = False,
):
    """One lab launch over ``x.shape[0]`` rows (tensors contiguous ``[T, H]``; ``y`` None: no normed
    output; ``q`` uint8 ``[T, H / 2]``; ``sf`` uint8 scales in the layout ``swizzled`` says)."""
    n_rows, hidden = x.shape
    block, group, vec = row_shape(hidden, "nvfp4", x.element_size())
    knobs = VARIANTS[variant]
    extra = {"launch_pdl": True} if pdl else {}
    return lab_kernel[(grid_rows(n_rows, knobs["ROWS"], swizzled),)](
        x, res, w, scale, h, h if y is None else y, q, sf, n_rows, x.stride(0), res.stride(0), h.stride(0),
        float(eps), float(weight_offset), HIDDEN=hidden, BLOCK=block, GROUP=group, VEC=vec, SWIZZLED=swizzled,
        WRITE_NORMED=y is not None, SOFT=soft, SOFT_FP8=soft_fp8, USE_PDL=pdl, num_warps=num_warps, **knobs,
        **extra,
    )  # fmt: skip


def launch_production(
    x,
    res,
    w,
    scale,
    h,
    y,
    q,
    sf,
    *,
    eps: float,
    weight_offset: float,
    swizzled: bool,
    num_warps: int,
    soft: bool = False,
    soft_fp8: bool = False,
    pdl: bool = False,
):
    """The production kernel with the same arguments as :func:`launch_lab`."""
    n_rows, hidden = x.shape
    block, group, vec = row_shape(hidden, "nvfp4", x.element_size())
    kernel = K.fused_add_rmsnorm_quant_kernel
    consts = {
        "HIDDEN": hidden, "BLOCK": block, "GROUP": group, "VEC": vec, "NUM_PARTIALS": 1, "QUANT": 3,
        "SWIZZLED": swizzled, "WRITE_NORMED": y is not None, "ROUND_BEFORE_WEIGHT": False, "SOFT": soft,
        "SOFT_FP8": soft_fp8, "USE_PDL": pdl, "HAS_RESIDUAL": True,
    }  # fmt: skip
    consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
    extra = {"launch_pdl": True} if pdl else {}
    grid = n_rows + (padding_programs(n_rows) if swizzled else 0)
    return kernel[(grid,)](
        x, res, w, scale, h, h if y is None else y, q, sf, n_rows, x.stride(0), res.stride(0), h.stride(0),
        float(eps), float(weight_offset), num_warps=num_warps, **consts, **extra,
    )  # fmt: skip
