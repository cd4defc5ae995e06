"""The Triton kernels: one shared norm/quant epilogue, and the fused kernel of the ``triton`` backend.

Per row ``t`` (``H`` = hidden size, ``D`` = the dtype, ``W`` = ``NUM_PARTIALS``; docs/numerics.md,
"Numerics contract")::

    s   = D(sum_{r<W} fp32(x[r, t]))              # W = 1: x is the already all-reduced sum
    h   = D(fp32(s) + fp32(res[t]))               -> h_ptr (the new residual; HAS_RESIDUAL=False: h = s)
    n   = fp32(h) * (1 / sqrt_rn(sum(fp32(h)**2) / H + eps))
                                                  (NORMALIZE_UNROUNDED: fp32(s) + fp32(res[t]) for fp32(h))
    y   = D(n * (fp32(w) + weight_offset))        (ROUND_BEFORE_WEIGHT: D(fp32(D(n)) * (...)))
                                                  -> y_ptr (when WRITE_NORMED)
    q   = Q(fp32(y))                              -> q_ptr (codes, uint8), sf_ptr (scales)

Steps 2-4 are :func:`norm_quant_epilogue`, the one code path every arnorm Triton kernel ends with
(``triton``'s :func:`fused_add_rmsnorm_quant_kernel` after loading or summing ``s``; ``triton_symm``
after summing the peers' partials from symmetric memory).

Every division and the square root are IEEE round-to-nearest (``tl.div_rn``, ``tl.sqrt_rn``):
Triton's ``/`` lowers to ``div.full.f32`` (about 2 ulp) on NVIDIA GPUs, which would break the
bit-exact quantizer contract. The row lives in registers as ``[BLOCK // VEC, VEC]``
(:func:`row_offsets`): consecutive threads hold consecutive 16-byte slices, and a quantization
block of ``GROUP`` elements (16 for nvfp4, 32 for mxfp8) is ``GROUP // VEC`` neighbouring threads,
reshaped to ``[BLOCK // GROUP, GROUP // VEC, VEC]`` for its amax.
``BLOCK = max(next_pow2(H), 4 * GROUP)``; lanes at or beyond ``H`` are masked and load as zero.

Quantized outputs (``QUANT``: 0 none, else the format's code in arnorm's format table,
:data:`QUANT_CODES`: 1 fp8_static, 2 fp8_per_token, 3 nvfp4, 4 mxfp8), all stored as bytes so the
kernel never needs an fp8 pointer type:

- fp8 (1, 2) and mxfp8 (4): e4m3 codes ``[T, H]``; per-token scales fp32 ``[T]``.
- nvfp4: e2m1 pairs ``[T, H/2]``, low nibble first; e4m3 block scales.
- nvfp4 / mxfp8 block scales: ``linear`` ``[T, K]`` or ``swizzled_128x4``
  ``[round_up(T, 128), round_up(K, 4)]`` (K = H / GROUP). In the swizzled layout each row program
  also writes its padding columns, and extra programs (:func:`zero_padding_rows`) zero the padding
  rows (``>= T``), so the output needs no memset.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from arnorm.plugin import FORMAT_SPECS
from arnorm_triton._casts import (
    E4M3_MAX,
    abs_max,
    e2m1_code,
    e2m1_code_fma,
    e4m3_bits,
    e4m3_decode,
    to_dtype_rne,
    to_fp32,
    ue8m0_round_up,
    ue8m0_to_inv_scale,
)
from arnorm_triton._sum_order import aten_sum, torch_sum_lanes

__all__ = [
    "INTERPRETED",
    "PAD_ROWS_PER_PROGRAM",
    "QUANT_CODES",
    "SCALE_LAYOUT_CODES",
    "epilogue_operands",
    "fused_add_rmsnorm_quant_kernel",
    "is_swizzled",
    "norm_quant_apply",
    "norm_quant_epilogue",
    "padding_programs",
    "row_offsets",
    "row_shape",
    "zero_padding_rows",
]

#: Swizzled scale padding rows zeroed per extra program.
PAD_ROWS_PER_PROGRAM = tl.constexpr(32)
#: The kernels' QUANT constexpr: 0 without quantization, else the format's code in arnorm's format
#: table (``FormatSpec.code``, append-only and pinned by a test: fp8_static 1, fp8_per_token 2,
#: nvfp4 3, mxfp8 4; the kernels branch on these, the launch tables are keyed on them).
QUANT_CODES: dict[str | None, int] = {None: 0, **{name: spec.code for name, spec in FORMAT_SPECS.items()}}
#: The codes the kernels' quantizer branches on, by name (a kernel never spells a code's number).
_FP8_STATIC = tl.constexpr(QUANT_CODES["fp8_static"])
_FP8_PER_TOKEN = tl.constexpr(QUANT_CODES["fp8_per_token"])
_NVFP4 = tl.constexpr(QUANT_CODES["nvfp4"])
_MXFP8 = tl.constexpr(QUANT_CODES["mxfp8"])
_FP8_GROUP = tl.constexpr(QUANT_CODES["fp8_per_group"])
_FP8_GROUP_64 = tl.constexpr(QUANT_CODES["fp8_per_group_64"])
_FP8_GROUP_UE8M0 = tl.constexpr(QUANT_CODES["fp8_per_group_ue8m0"])
_FP8_GROUP_64_UE8M0 = tl.constexpr(QUANT_CODES["fp8_per_group_64_ue8m0"])
_MXFP4 = tl.constexpr(QUANT_CODES["mxfp4"])
# The quantizer takes the per-group fp8 formats as one range of codes, the UE8M0 ones last.
assert list(range(_FP8_GROUP, _FP8_GROUP + 4)) == [
    _FP8_GROUP,
    _FP8_GROUP_64,
    _FP8_GROUP_UE8M0,
    _FP8_GROUP_64_UE8M0,
]
#: SCALE_LAYOUT: how the per-group fp8 formats store their fp32 scales (0 for every other format,
#: whose layout SWIZZLED says). The codes are this module's own, never stored anywhere.
SCALE_LAYOUT_CODES: dict[str | None, int] = {
    None: 0,
    "linear": 0,
    "swizzled_128x4": 0,
    "column_major": 1,
    "column_major_tma": 2,
    "packed_ue8m0": 3,
}
_COLUMN_MAJOR = tl.constexpr(1)
_COLUMN_MAJOR_TMA = tl.constexpr(2)
_PACKED_UE8M0 = tl.constexpr(3)
#: GROUP for the formats without block scales: any power of two the row shape accepts.
_NO_BLOCK_GROUP = 16


def row_shape(hidden: int, quant: str | None, itemsize: int) -> tuple[int, int, int]:
    """``(BLOCK, GROUP, VEC)`` constexprs for a row of ``hidden`` elements of ``itemsize`` bytes
    quantized as ``quant`` (GROUP: the format's block size): VEC elements are one 16-byte access."""
    block = FORMAT_SPECS[quant].block_size if quant is not None else None
    group = block or _NO_BLOCK_GROUP
    return max(triton.next_power_of_2(hidden), 4 * group), group, 16 // itemsize


def is_swizzled(quant: str | None, layout: str | None) -> bool:
    """Whether a kernel for ``quant`` in ``layout`` stores 128x4-swizzled block scales (``SWIZZLED``)."""
    return quant is not None and bool(FORMAT_SPECS[quant].block_size) and layout == "swizzled_128x4"


def padding_programs(n_rows: int) -> int:
    """Extra programs that zero the swizzled padding rows ``[T, round_up(T, 128))``, 32 rows each."""
    return ((n_rows + 127) // 128 * 128 - n_rows + 31) // 32


def _f32(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


#: fp32(1/6), fp32(1/448) and the per-token scale floor fp32(1/(448*512)), given by their bits so
#: no literal rounding is involved (the same constants as arnorm.quant's).
_INV_E2M1_MAX = tl.constexpr(_f32(0x3E2AAAAB))
_INV_E4M3_MAX = tl.constexpr(_f32(0x3B124925))
_MIN_TOKEN_SCALE = tl.constexpr(_f32(0x36924925))
#: fp32(1e-10): the per-group fp8 formats' floor of a group's amax (arnorm.quant's EPS).
_GROUP_EPS = tl.constexpr(_f32(0x2EDBE6FF))
#: The per-group fp8 formats' code of a NaN quotient (-448) and mxfp4's of a NaN element (6).
_GROUP_NAN_CODE = tl.constexpr(0xFE)
_MXFP4_NAN_CODE = tl.constexpr(0x7)
#: nvfp4: below this |global scale| the encode scale gs / SF (SF >= 2**-9 or 0) is finite.
_NVFP4_FAST_SCALE = tl.constexpr(float(2**118))


@triton.jit
def row_offsets(HIDDEN: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """``(offs, mask)``: element offsets ``[BLOCK // VEC, VEC]`` within one row (row-major:
    ``offs[i, v] = i * VEC + v``) and ``offs < HIDDEN``; the epilogue expects ``s`` in this shape.

    Why this shape: Triton picks each memory access's register layout from the contiguity it can
    prove, and a thread stores at most 16 bytes per instruction. With VEC elements (16 bytes) on
    the last axis and the slices on the first, thread ``i`` of a warp holds slice ``i``, so every
    load and store of the row shares one layout and each store instruction writes whole 32-byte
    sectors. An earlier ``[blocks, slices, VEC]`` shape made Triton give each thread whole
    quantization blocks, 32-64 bytes apart between neighbouring threads: each store then wrote
    sectors in halves or quarters, which cost mxfp8 a third of its bandwidth at T 8192 and every
    format up to 0.3-1.0 us at decode sizes (H200, kernel-variants run 21). A quantization block
    is now ``GROUP // VEC`` neighbouring threads; its amax is a reshape to
    ``[BLOCK // GROUP, GROUP // VEC, VEC]``, an in-thread reduction, then a shuffle.
    """
    offs = tl.arange(0, BLOCK // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    return offs, offs < HIDDEN


@triton.jit
def _swizzled_offset(row, blk, KP: tl.constexpr):
    """Byte offset of block scale (m = row, k = blk) in the 128x4 swizzle with KP padded columns:
    ``(m//128)*(KP/4)*512 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4`` (broadcasts)."""
    return (
        (row // 128) * (KP // 4 * 512)
        + (blk // 4) * 512
        + (row % 32) * 16
        + ((row % 128) // 32) * 4
        + blk % 4
    )


@triton.jit
def _max_abs_nan(a, b):
    """max(|a|, |b|), NaN if either is NaN (``max.NaN.f32``; abs is a free operand modifier)."""
    return tl.maximum(tl.abs(a), tl.abs(b), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _store_block_scales(sf_ptr, vals, row, blk, K: tl.constexpr, SWIZZLED: tl.constexpr):
    """Store one row's block scales ``vals`` ``[NB]`` (bytes) for block indices ``blk``; in the
    swizzled layout the padding columns k in [K, round_up(K, 4)) get 0."""
    if SWIZZLED:
        KP: tl.constexpr = (K + 3) // 4 * 4
        tl.store(
            sf_ptr + _swizzled_offset(row, blk, KP), tl.where(blk < K, vals, 0).to(tl.uint8), mask=blk < KP
        )
    else:
        tl.store(sf_ptr + row * K + blk, vals.to(tl.uint8), mask=blk < K)


@triton.jit
def _pow2_round_up(s):
    """Non-negative fp32 ``s`` -> the smallest power of two ``>= s``, exactly (inf, NaN, powers of
    two and zero unchanged): add the mantissa mask so any set bit carries into the exponent."""
    bits = s.to(tl.int32, bitcast=True)
    up = (bits + 0x7FFFFF) & 0x7F800000
    keep = ((bits & 0x7FFFFF) == 0) | ((bits & 0x7F800000) == 0x7F800000)
    return tl.where(keep, bits, up).to(tl.float32, bitcast=True)


@triton.jit
def _store_group_scales(sf_ptr, vals, row, blk, n_rows, K: tl.constexpr, SCALE_LAYOUT: tl.constexpr):
    """Store one row's fp32 group scales ``vals`` ``[NB]`` in ``SCALE_LAYOUT`` (``arnorm/_formats.py``
    gives each); the last row's program also zeroes the TMA layouts' padding rows, and each row
    writes the packed layout's padding groups as 0."""
    if SCALE_LAYOUT == _COLUMN_MAJOR:
        tl.store(sf_ptr + blk * n_rows + row, vals, mask=blk < K)
    elif SCALE_LAYOUT == _COLUMN_MAJOR_TMA:
        rows_p = (n_rows + 3) // 4 * 4
        tl.store(sf_ptr + blk * rows_p + row, vals, mask=blk < K)
        if row == n_rows - 1:
            pad = n_rows + tl.arange(0, 4)[:, None]
            tl.store(sf_ptr + blk[None, :] * rows_p + pad, tl.zeros([4, blk.shape[0]], tl.float32),
                     mask=(pad < rows_p) & (blk[None, :] < K))  # fmt: skip
    elif SCALE_LAYOUT == _PACKED_UE8M0:
        rows_p = (n_rows + 3) // 4 * 4
        KP: tl.constexpr = (K + 3) // 4 * 4
        exps = tl.where(blk < K, (vals.to(tl.int32, bitcast=True) >> 23) & 0xFF, 0).to(tl.uint8)
        bytes_ptr = sf_ptr.to(tl.pointer_type(tl.uint8))
        tl.store(bytes_ptr + ((blk // 4) * rows_p + row) * 4 + blk % 4, exps, mask=blk < KP)
        if row == n_rows - 1:
            pad = n_rows + tl.arange(0, 4)[:, None]
            b = blk[None, :]
            tl.store(bytes_ptr + ((b // 4) * rows_p + pad) * 4 + b % 4, tl.zeros([4, blk.shape[0]], tl.uint8),
                     mask=(pad < rows_p) & (b < KP))  # fmt: skip
    else:
        tl.store(sf_ptr + row * K + blk, vals, mask=blk < K)


@triton.jit
def _nan_free_abs_max(yb):
    """The bits (int32) of ``max |x|`` over each block of ``yb`` ``[NB, S, VEC]`` with NaN left out;
    -1 where every value is NaN. Integer maxima of the bit patterns, as :func:`abs_max`'s (the
    non-negative floats order as their bits do), the same on a GPU and in the interpreter."""
    bits = yb.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bits = tl.where(bits > 0x7F800000, -1, bits)
    return tl.max(tl.max(bits, 2), 1)


@triton.jit
def _mxfp4_codes(yb):
    """``(codes [NB, GROUP // VEC, VEC] as int32, scale bytes [NB])`` of mxfp4 for fp32 blocks ``yb``
    (``arnorm/quant/_mxfp4.py`` defines each step)."""
    amax = _nan_free_abs_max(yb)
    amax = tl.where(amax < 0, 0x7FC00000, amax)  # every value NaN: the maximum is NaN
    exp = ((amax + 0x200000) & 0x7F800000) >> 23  # a NaN's carry past the exponent leaves 0
    u = tl.where(exp == 0xFF, 127, tl.maximum(exp - 129, -127))
    mult = tl.where(u == 127, 0x400000, (127 - u) << 23).to(tl.float32, bitcast=True)
    v = yb * mult[:, None, None]
    code = tl.where(v != v, _MXFP4_NAN_CODE, e2m1_code(v).to(tl.int32))
    return code, (u + 127).to(tl.uint8)


@triton.jit
def zero_padding_rows(sf_ptr, pad_program, n_rows, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                      GROUP: tl.constexpr):  # fmt: skip
    """Zero the swizzled scale rows ``[T + 32 p, T + 32 p + 32)`` below ``round_up(T, 128)``
    (``p = pad_program``; :func:`padding_programs` of them cover every padding row).

    A row's scales of blocks ``4 g .. 4 g + 3`` are 4 contiguous bytes of the swizzle (``k % 4``
    is the innermost term), so each is zeroed as one 32-bit word at a 4-byte aligned offset: a
    quarter of the byte stores, which at decode sizes (T < 128: up to 127 padding rows) are on
    the critical path of the launch."""
    NB: tl.constexpr = BLOCK // GROUP
    K: tl.constexpr = HIDDEN // GROUP
    KP: tl.constexpr = (K + 3) // 4 * 4
    rows = n_rows + pad_program * PAD_ROWS_PER_PROGRAM + tl.arange(0, PAD_ROWS_PER_PROGRAM)[:, None]
    g = tl.arange(0, NB // 4)[None, :]  # NB is a power of two >= 4, so this is one too
    mask = (rows < (n_rows + 127) // 128 * 128) & (g < KP // 4)
    words = sf_ptr.to(tl.pointer_type(tl.int32))
    tl.store(
        words + _swizzled_offset(rows, g * 4, KP) // 4,
        tl.zeros([PAD_ROWS_PER_PROGRAM, NB // 4], tl.int32),
        mask=mask,
    )


@triton.jit
def epilogue_operands(row, res_ptr, res_stride, w_ptr, scale_ptr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                      GROUP: tl.constexpr, VEC: tl.constexpr, QUANT: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr = True):  # fmt: skip
    """``(res, w, scale)``: the loads of :func:`norm_quant_epilogue` for row ``row`` (the residual
    row and the weight as stored, in :func:`row_offsets` order; the fp32 scale, or 1.0 for the
    formats without one). A kernel that must wait before it has the row's sum (``triton_symm``)
    issues them before the wait, so they leave its critical path; :func:`norm_quant_apply` takes
    them. With ``HAS_RESIDUAL=False`` ``res`` is zeros and ``res_ptr`` is never read."""
    offs, mask = row_offsets(HIDDEN, BLOCK, VEC)
    if HAS_RESIDUAL:
        # evict_last, as the row's load in the fused kernel (why: see there).
        res = tl.load(
            res_ptr + row.to(tl.int64) * res_stride + offs, mask=mask, other=0.0, eviction_policy="evict_last"
        )
    else:
        res = tl.zeros(offs.shape, w_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    # The formats that take an input scale. Not `QUANT in (...)`: the interpreter runs it, the
    # compiler refuses it (tests/arnorm_triton/test_kernel_source.py).
    if QUANT == _FP8_STATIC or QUANT == _NVFP4:  # noqa: SIM109
        scale = tl.load(scale_ptr)
    else:
        scale = tl.full([], 1.0, tl.float32)
    return res, w, scale


@triton.jit
def norm_quant_epilogue(
    s, row, res_ptr, res_stride, h_ptr, h_stride, w_ptr, scale_ptr, y_ptr, q_ptr, sf_ptr, eps, weight_offset,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, VEC: tl.constexpr, QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr, WRITE_NORMED: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
    SOFT: tl.constexpr, SOFT_FP8: tl.constexpr, HAS_RESIDUAL: tl.constexpr = True,
    NORMALIZE_UNROUNDED: tl.constexpr = False, SCALE_LAYOUT: tl.constexpr = 0, n_rows=1,
):  # fmt: skip
    """Steps 2-4 of the contract for one row, from its reduced sum ``s``; writes every output.

    Args:
        s: fp32 in :func:`row_offsets` order: the reduced row, already rounded to the dtype
            ``D`` (``fp32(D(sum))``); lanes ``>= HIDDEN`` are ignored.
        row: the row index ``t`` (int32 or int64 scalar), ``0 <= t < T``.
        res_ptr, res_stride: residual input ``[T, H]`` in ``D``; row ``t`` starts at
            ``res_ptr + t * res_stride`` (unit column stride).
        h_ptr, h_stride: new residual output ``h = D(s + res)`` in ``D``, row ``t`` at
            ``h_ptr + t * h_stride``. ``D`` is taken from ``h_ptr``'s element type. May be the
            buffer ``s`` was read from (each element is read before it is written).
        w_ptr: norm weight ``[H]`` in ``D``. ``weight_offset``: fp32, added to it (1 for Gemma).
        scale_ptr: fp32 ``[1]``: fp8_static dequant scale / nvfp4 global encode scale (read only
            for those formats; any pointer otherwise).
        y_ptr: normed output, contiguous ``[T, H]`` in ``D``; written when ``WRITE_NORMED``.
        q_ptr: uint8 codes, contiguous: ``[T, H]`` (fp8, mxfp8) or ``[T, H / 2]`` (nvfp4, low
            nibble first); untouched when ``QUANT == 0``.
        sf_ptr: scales: fp32 ``[T]`` (fp8_per_token); uint8 block scales ``[T, H / GROUP]``
            (linear) or the swizzled 128x4 layout (``SWIZZLED``: this row's padding columns are
            written as 0; padding *rows* are :func:`zero_padding_rows`' job). Untouched otherwise.
        eps: fp32 epsilon.
        HIDDEN, BLOCK, GROUP, VEC: as :func:`row_shape` / :func:`row_offsets`.
        QUANT: 0 none, 1 fp8_static, 2 fp8_per_token, 3 nvfp4, 4 mxfp8 (:data:`QUANT_CODES`).
        ROUND_BEFORE_WEIGHT: round ``x * rsqrt(...)`` to ``D`` before the weight multiply.
        SOFT, SOFT_FP8: integer-bit bf16 / e4m3 rounding (:mod:`arnorm_triton._casts`).
        HAS_RESIDUAL: False for ops built with ``add_residual=False``: ``h = s``, and ``res_ptr``
            is never read.
        NORMALIZE_UNROUNDED: the statistic and ``n`` read the fp32 ``s + res`` (still in
            registers) instead of ``fp32(h)``; ``h`` is stored rounded all the same.
        SCALE_LAYOUT, n_rows: the per-group fp8 formats' scale layout (:data:`SCALE_LAYOUT_CODES`)
            and ``T``, which the column-major layouts' row stride is made of.

    Writes exactly: ``h`` row ``t``; ``y`` row ``t`` (WRITE_NORMED); codes row ``t`` and this row's
    scales (QUANT > 0). Reads ``res``, ``w``, ``scale`` and nothing else; no barrier beyond the
    row reductions, so it may run for several rows per program. Callers using programmatic
    dependent launch must have waited (``gdc_wait``) before calling it. It is
    :func:`epilogue_operands` then :func:`norm_quant_apply`.
    """
    # Every load first: the weight and the scale leave the critical path of the reductions.
    res, w, scale = epilogue_operands(row, res_ptr, res_stride, w_ptr, scale_ptr, HIDDEN, BLOCK, GROUP, VEC,
                                      QUANT, HAS_RESIDUAL)  # fmt: skip
    norm_quant_apply(s, res, w, scale, row, h_ptr, h_stride, y_ptr, q_ptr, sf_ptr, eps, weight_offset, HIDDEN,
                     BLOCK, GROUP, VEC, QUANT, SWIZZLED, WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT, SOFT_FP8,
                     HAS_RESIDUAL, NORMALIZE_UNROUNDED, SCALE_LAYOUT, n_rows)  # fmt: skip


@triton.jit
def norm_quant_apply(
    s, res, w, scale, row, h_ptr, h_stride, y_ptr, q_ptr, sf_ptr, eps, weight_offset, HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, VEC: tl.constexpr, QUANT: tl.constexpr, SWIZZLED: tl.constexpr,
    WRITE_NORMED: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, SOFT: tl.constexpr, SOFT_FP8: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr = True, NORMALIZE_UNROUNDED: tl.constexpr = False,
    SCALE_LAYOUT: tl.constexpr = 0, n_rows=1,
):  # fmt: skip
    """:func:`norm_quant_epilogue` with its loads already made (``res, w, scale`` as
    :func:`epilogue_operands` returns them): steps 2-4, every store."""
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    NB: tl.constexpr = BLOCK // GROUP
    blk = tl.arange(0, NB)
    offs, mask = row_offsets(HIDDEN, BLOCK, VEC)
    row64 = row.to(tl.int64)
    w = to_fp32(w, SOFT) + weight_offset

    # Step 2: h = D(s + res), rounded before the statistic (the contract's order), unless the norm
    # reads the unrounded sum (vLLM's fused_add_rms_norm order).
    if HAS_RESIDUAL:
        unrounded = s + to_fp32(res, SOFT)
        h = to_dtype_rne(unrounded, DTYPE, SOFT)
    else:  # s is already D-valued: the rounding is exact
        unrounded = s
        h = to_dtype_rne(s, DTYPE, SOFT)
    tl.store(h_ptr + row64 * h_stride + offs, h, mask=mask)
    if NORMALIZE_UNROUNDED:
        hf = unrounded
    else:
        hf = to_fp32(h, SOFT)

    # Step 3: y, with a correctly rounded mean, square root and reciprocal.
    # A power-of-two H could multiply by 1 / H (the same rounding), but on the H200 that made
    # ptxas schedule the normed variants worse (fp8_static, mxfp8 at T 8192: 6-7% slower): kept.
    # Interpreted, the squares are summed in torch's CPU order (_sum_order.py: bitwise with
    # torch-native norms there); compiled, in a tree.
    if _SUM_LANES == 0:
        sum_sq = tl.sum(tl.sum(hf * hf, axis=1), axis=0)
    else:
        sum_sq = aten_sum(tl.reshape(hf * hf, [BLOCK]), HIDDEN, BLOCK, _SUM_LANES)
    mean_sq = tl.div_rn(sum_sq, HIDDEN * 1.0)
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    n = hf * inv_rms
    if ROUND_BEFORE_WEIGHT:
        n = to_fp32(to_dtype_rne(n, DTYPE, SOFT), SOFT)
    y = to_dtype_rne(n * w, DTYPE, SOFT)
    base = row64 * HIDDEN
    if WRITE_NORMED:
        tl.store(y_ptr + base + offs, y, mask=mask)
    yf = to_fp32(y, SOFT)

    # Step 4: the quantizer reads the D-rounded y; amaxes propagate NaN as torch's amax does.
    if QUANT == _FP8_STATIC:  # satfinite_rn(y * fp32(1 / scale))
        tl.store(q_ptr + base + offs, e4m3_bits(yf * tl.div_rn(1.0, scale), SOFT_FP8, False), mask=mask)
    elif QUANT == _FP8_PER_TOKEN:  # scale_t = max(amax_t / 448, 1 / (448 * 512)), q = y / scale_t
        amax = abs_max(abs_max(yf, 1), 0)
        tok_scale = tl.maximum(tl.div_rn(amax, E4M3_MAX), _MIN_TOKEN_SCALE, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + base + offs, e4m3_bits(tl.div_rn(yf, tok_scale), SOFT_FP8, False), mask=mask)
        tl.store(sf_ptr + row64, tok_scale)
    elif QUANT == _NVFP4:  # SF = e4m3(gs * (amax16 * fp32(1/6))), q = e2m1(y * (gs / SF))
        yb = tl.reshape(yf, [NB, GROUP // VEC, VEC])  # a block's slices: neighbouring threads
        # A float amax is abs_max's value up to the NaN payload, which no later step reads.
        amax = tl.reduce(tl.reduce(yb, 2, _max_abs_nan), 1, _max_abs_nan)
        sf_code = e4m3_bits(scale * (amax * _INV_E2M1_MAX), SOFT_FP8)
        # SF keeps its sign: a negative global scale gives negative SFs, and S / SF must stay
        # positive for the codes to keep y's sign (the reference's Q decodes SF signed).
        if SOFT_FP8:
            sf = e4m3_decode(sf_code & 0x7F)
            sf = tl.where((sf_code & 0x80) != 0, -sf, sf)
        else:  # exact in hardware (e4m3 -> f16 -> f32)
            sf = sf_code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        enc = tl.where(sf == 0.0, 0.0, tl.div_rn(scale, tl.where(sf == 0.0, 1.0, sf)))
        v = yb * enc[:, None, None]
        if tl.abs(scale) < _NVFP4_FAST_SCALE:  # enc finite: a NaN v only in a NaN block (zeroed below)
            codes = e2m1_code_fma(v)
        else:
            codes = e2m1_code(v).to(tl.int32)
        # The VEC codes of a 16-byte slice as one word, nibble i = element i (no byte permutes):
        # thread i holds word i of the row.
        words = tl.sum(codes << (tl.arange(0, VEC) * 4)[None, None, :], axis=2)
        words = tl.where((enc != enc)[:, None], 0, words)
        WORD: tl.constexpr = tl.int32 if VEC == 8 else tl.int16
        words = tl.reshape(words.to(WORD), [BLOCK // VEC])
        woffs = tl.arange(0, BLOCK // VEC)
        wptr = (q_ptr + row64 * (HIDDEN // 2)).to(tl.pointer_type(WORD))
        # Contiguity 1 on purpose: a wider store would convert the words' layout through shared
        # memory; one word per thread from the reduction's layout is already whole sectors.
        tl.store(wptr + tl.max_contiguous(woffs, [1]), words, mask=woffs < HIDDEN // VEC)
        _store_block_scales(sf_ptr, sf_code, row64, blk, HIDDEN // GROUP, SWIZZLED)
    elif QUANT == _MXFP8:  # e = ue8m0_round_up(amax32 * fp32(1/448)), q = e4m3(y * 2**(127 - e))
        yb = tl.reshape(yf, [NB, GROUP // VEC, VEC])  # a block's slices: neighbouring threads
        e = ue8m0_round_up(abs_max(abs_max(yb, 2), 1) * _INV_E4M3_MAX)
        q = e4m3_bits(yb * ue8m0_to_inv_scale(e)[:, None, None], SOFT_FP8)
        tl.store(q_ptr + base + offs, tl.reshape(q, [BLOCK // VEC, VEC]), mask=mask)
        _store_block_scales(sf_ptr, e, row64, blk, HIDDEN // GROUP, SWIZZLED)
    elif QUANT >= _FP8_GROUP and QUANT <= _FP8_GROUP_64_UE8M0:  # the per-group fp8 formats
        # s = max(amax_g, 1e-10) * fp32(1/448) (UE8M0: rounded up to a power of two), q = e4m3(y / s)
        yb = tl.reshape(yf, [NB, GROUP // VEC, VEC])
        amax = tl.maximum(_nan_free_abs_max(yb), 0).to(tl.float32, bitcast=True)  # every value NaN: 0
        gs = tl.maximum(amax, _GROUP_EPS) * _INV_E4M3_MAX
        if QUANT >= _FP8_GROUP_UE8M0:
            gs = _pow2_round_up(gs)
        quotient = tl.div_rn(yb, gs[:, None, None])
        q = tl.where(quotient != quotient, _GROUP_NAN_CODE, e4m3_bits(quotient, SOFT_FP8, False))
        tl.store(q_ptr + base + offs, tl.reshape(q, [BLOCK // VEC, VEC]), mask=mask)
        _store_group_scales(sf_ptr, gs, row64, blk, n_rows, HIDDEN // GROUP, SCALE_LAYOUT)
    elif QUANT == _MXFP4:  # u from amax32 rounded at its second mantissa bit, q = e2m1(y * 2**-u)
        codes, sf_code = _mxfp4_codes(tl.reshape(yf, [NB, GROUP // VEC, VEC]))
        # The VEC codes of a 16-byte slice as one word, nibble i = element i, as nvfp4's.
        words = tl.sum(codes << (tl.arange(0, VEC) * 4)[None, None, :], axis=2)
        WORD4: tl.constexpr = tl.int32 if VEC == 8 else tl.int16
        words = tl.reshape(words.to(WORD4), [BLOCK // VEC])
        woffs = tl.arange(0, BLOCK // VEC)
        wptr = (q_ptr + row64 * (HIDDEN // 2)).to(tl.pointer_type(WORD4))
        tl.store(wptr + tl.max_contiguous(woffs, [1]), words, mask=woffs < HIDDEN // VEC)
        _store_block_scales(sf_ptr, sf_code, row64, blk, HIDDEN // GROUP, SWIZZLED)


@triton.jit(do_not_specialize=["n_rows"], do_not_specialize_on_alignment=["scale_ptr"])
def fused_add_rmsnorm_quant_kernel(
    x_ptr,  # [W, T, H] partials in D (W = 1: the reduced sum); may alias h_ptr when W = 1
    res_ptr,  # [T, H] residual in D
    w_ptr,  # [H] norm weight in D
    scale_ptr,  # fp32 [1]: fp8_static dequant scale / nvfp4 global encode scale (else any pointer)
    h_ptr,  # [T, H] new residual out, D
    y_ptr,  # [T, H] normed out, D (any pointer unless WRITE_NORMED)
    q_ptr,  # uint8 codes (any pointer when QUANT == 0)
    sf_ptr,  # scales out: fp32 [T] per token; uint8 block scales (any pointer otherwise)
    n_rows,  # T: rows with data; the swizzled grid has padding_programs(T) more programs
    x_stride,  # row stride of x (W > 1: H, the partials are contiguous [W, T, H])
    res_stride,  # row stride of res
    h_stride,  # row stride of h
    eps,  # fp32
    weight_offset,  # fp32: 0 plain, 1 Gemma
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    VEC: tl.constexpr,  # elements per 16-byte access of D
    NUM_PARTIALS: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    SOFT: tl.constexpr,  # integer-bit bf16 rounding (the interpreter)
    SOFT_FP8: tl.constexpr,  # integer-bit e4m3 rounding (interpreter, pre-SM89, ROCm)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (SM 9.0+, launched with launch_pdl)
    HAS_RESIDUAL: tl.constexpr,  # False: add_residual=False, res_ptr is never read
    NORMALIZE_UNROUNDED: tl.constexpr = False,  # the norm reads fp32(s) + fp32(res), not fp32(h)
    SCALE_LAYOUT: tl.constexpr = 0,  # the per-group fp8 formats' scale layout (SCALE_LAYOUT_CODES)
):
    """One program per row; with swizzled block scales, :func:`padding_programs` more programs
    zero the padding rows of the last 128-row tile, 32 rows each.

    With ``USE_PDL`` the program waits for the preceding grid (``griddepcontrol.wait``) before
    its first load, and lets the next grid launch only after every store of this program.
    """
    row = tl.program_id(0)
    if row < n_rows:
        offs, mask = row_offsets(HIDDEN, BLOCK, VEC)
        row64 = row.to(tl.int64)
        x_row = x_ptr + row64 * x_stride + offs
        if USE_PDL:  # the addresses above need nothing from the preceding grid; every load does
            tl.extra.cuda.gdc_wait()
        # Step 1: s. Exact mode sums the gathered partials in fp32 from rank 0 up, one rounding to D.
        # The row and the residual are read once, yet loading them evict_last (the stores keep the
        # default policy) is 1-3% faster at T 8192 with the normed output or nvfp4, in place or
        # not, and the same elsewhere (H200, kernel-variants runs 32-33).
        acc = to_fp32(tl.load(x_row, mask=mask, other=0.0, eviction_policy="evict_last"), SOFT)
        if NUM_PARTIALS > 1:
            partial = n_rows.to(tl.int64) * x_stride
            for r in tl.static_range(1, NUM_PARTIALS):
                x = tl.load(x_ptr + r * partial + row64 * x_stride + offs, mask=mask, other=0.0)
                acc = acc + to_fp32(x, SOFT)
            acc = to_fp32(to_dtype_rne(acc, h_ptr.dtype.element_ty, SOFT), SOFT)
        norm_quant_epilogue(acc, row, res_ptr, res_stride, h_ptr, h_stride, w_ptr, scale_ptr, y_ptr, q_ptr,
                            sf_ptr, eps, weight_offset, HIDDEN, BLOCK, GROUP, VEC, QUANT, SWIZZLED,
                            WRITE_NORMED, ROUND_BEFORE_WEIGHT, SOFT, SOFT_FP8, HAS_RESIDUAL,
                            NORMALIZE_UNROUNDED, SCALE_LAYOUT, n_rows)  # fmt: skip
    else:
        if SWIZZLED:
            if USE_PDL:  # the preceding grid may still read the scales these programs overwrite
                tl.extra.cuda.gdc_wait()
            zero_padding_rows(sf_ptr, row - n_rows, n_rows, HIDDEN, BLOCK, GROUP)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def is_interpreted() -> bool:
    """Whether this module's kernels were built by the Triton interpreter (``TRITON_INTERPRET=1``
    when the module was first imported: Triton reads it in the ``@triton.jit`` decorator)."""
    return not hasattr(fused_add_rmsnorm_quant_kernel, "device_caches")


INTERPRETED: bool = is_interpreted()
#: The lanes of torch's CPU sum when interpreted (0 when unknown), else 0: norm_quant_apply's order.
_SUM_LANES = tl.constexpr(torch_sum_lanes() if INTERPRETED else 0)
