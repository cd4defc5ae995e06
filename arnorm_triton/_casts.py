"""Bit-exact conversions for the fused kernel, correct on a GPU and in the Triton interpreter.

The interpreter (Triton 3.6 to 3.9, ``TRITON_INTERPRET=1``) gets three conversions wrong
(research/feasibility.md, section 2): fp32 -> bf16 truncates instead of rounding to nearest even,
fp32 -> float8_e4m3fn rounds ties away from zero and loses a factor of two on mantissa carry, and
bf16 -> fp32 mis-decodes subnormals. Every such conversion in the kernel goes through this module:

- ``SOFT=False``: the hardware conversion (``cvt.rn.bf16.f32``, ``cvt.rn.satfinite.e4m3x2.f32``).
- ``SOFT=True``: round to nearest even in integer arithmetic on the fp32 bit pattern. Exact
  everywhere; the backend turns it on in the interpreter, and for fp8 also where the GPU has no
  e4m3 conversion (CUDA before SM 8.9, ROCm, whose ``float8e4nv`` support varies).

The rest (e4m3 decode, e2m1 codes, the E8M0 round-up) are integer or comparison arithmetic on
both paths: they are exact by construction and cost nothing next to the memory traffic.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "E4M3_MAX",
    "e2m1_code",
    "e2m1_code_fma",
    "e4m3_bits",
    "e4m3_decode",
    "abs_max",
    "satfinite_e4m3",
    "to_dtype_rne",
    "to_fp32",
    "ue8m0_round_up",
    "ue8m0_to_inv_scale",
]

#: Largest finite float8_e4m3fn value (a constexpr: Triton kernels may only read constexpr globals).
E4M3_MAX = tl.constexpr(448.0)
#: A quiet fp32 NaN's bit pattern.
_F32_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def abs_max(x, axis: tl.constexpr):
    """``max |x|`` along ``axis``, NaN if any element is NaN (as torch's ``amax``).

    ``tl.max`` drops NaN (``max.f32`` on a GPU, ``nanmax`` in the interpreter). The bit patterns of
    non-negative floats order as integers do, and every NaN pattern lies above +inf, so an integer
    max over ``|x|``'s bits is the NaN-propagating float max, at the cost of a plain max.
    """
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(bits, axis=axis).to(tl.float32, bitcast=True)


@triton.jit
def to_fp32(x, SOFT: tl.constexpr):
    """Widen ``x`` (bf16, fp16 or fp32) to fp32 exactly.

    bf16 is the high half of an fp32 bit pattern, so the soft path shifts the bits into place
    (the interpreter mis-decodes bf16 subnormals); fp16 and fp32 widen through the normal cast.
    """
    if SOFT:
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even on the bit pattern; every NaN becomes 0x7FC0 (as torch)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    rounded = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
    return rounded.to(tl.bfloat16, bitcast=True)


@triton.jit
def satfinite_e4m3(x):
    """Clamp to [-448, 448]; NaN stays NaN (comparisons with NaN are false, unlike min/max)."""
    return tl.where(x > E4M3_MAX, E4M3_MAX, tl.where(x < -E4M3_MAX, -E4M3_MAX, x))


@triton.jit
def _e4m3_rne_bits(x):
    """fp32 in [-448, 448] or NaN -> float8_e4m3fn code as uint8, round to nearest even; signed
    zeros keep their sign, every NaN gives 0x7F (arnorm.quant's convention).

    Normal range (|x| >= 2**-6): add the RNE bias below the 3 kept mantissa bits, shift, rebias the
    exponent by 127 - 7 = 120 (a mantissa carry moves into the exponent, as it should).
    Subnormals are multiples of 2**-9: ``|x| * 512 + 2**23`` rounds to an integer k (0..8) in the
    fp32 adder itself, and k is the code (k = 8 is the smallest normal, 0x08). NaN -> 0x7F.
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    absb = bits & 0x7FFFFFFF
    normal = ((absb + 0x7FFFF + ((absb >> 20) & 1)) >> 20) - (120 << 3)
    sub = (tl.abs(x) * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    code = tl.where((absb >> 23) >= 121, normal, sub) | sign
    return tl.where(x != x, 0x7F, code).to(tl.uint8)


@triton.jit
def to_dtype_rne(x, DTYPE: tl.constexpr, SOFT: tl.constexpr):
    """fp32 ``x`` -> ``DTYPE`` (bf16, fp16, fp32 or float8e4nv), round to nearest even.

    float8e4nv saturates to +-448 first (``satfinite``: torch's own cast would give NaN above
    448, every kernel in the wild saturates); NaN stays NaN. ``SOFT`` selects integer-bit
    rounding for bf16 and e4m3 (exact in the interpreter); fp16 and fp32 are exact either way.
    """
    if tl.float32 == DTYPE:
        return x
    elif tl.float8e4nv == DTYPE:
        if SOFT:
            return _e4m3_rne_bits(satfinite_e4m3(x)).to(tl.float8e4nv, bitcast=True)
        else:
            return satfinite_e4m3(x).to(tl.float8e4nv)
    elif tl.bfloat16 == DTYPE:
        if SOFT:
            return _bf16_rne(x)
        else:
            return x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:
        return x.to(DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def e4m3_bits(x, SOFT: tl.constexpr, CLAMP: tl.constexpr = True):
    """fp32 -> saturated float8_e4m3fn code as uint8 (what the kernel stores); NaN -> 0x7F.

    The soft path never names the fp8 type, so it also compiles where Triton has no float8e4nv.
    ``CLAMP=False`` (hardware path only) leaves the saturation to the conversion itself: on
    CUDA SM 8.9+ (the only target of that path) Triton's one lowering of f32 -> e4m3 is
    ``cvt.rn.satfinite.e4m3x2.f32``, which rounds to nearest even and saturates finite values and
    infinities to +-448, the same bits as clamping first. It saves 48 of 600 instructions per
    program at H 8192 (fp8_static) and 0.1-0.2 us per decode call on the H200; the quantizers
    measured slower without the clamp (mxfp8) keep it (kernel-variants run 12).
    """
    if SOFT:
        return _e4m3_rne_bits(satfinite_e4m3(x))
    else:
        sat = satfinite_e4m3(x) if CLAMP else x
        # cvt gives every NaN as 0x7F too, but the sign of a NaN is not specified anywhere: pin it.
        code = sat.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(x != x, 0x7F, code).to(tl.uint8)


@triton.jit
def e4m3_decode(code):
    """Non-negative float8_e4m3fn code (uint8, 0..0x7F) -> its exact fp32 value (0x7F: NaN).

    Normal: exponent field e (1..15) rebiased by +120, the 3 mantissa bits placed on top of fp32's
    23; subnormal (e = 0): m * 2**-9.
    """
    c = code.to(tl.uint32)
    e = (c >> 3) & 0xF
    m = c & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    nan = tl.full(c.shape, _F32_NAN_BITS, tl.uint32).to(tl.float32, bitcast=True)
    return tl.where(c == 0x7F, nan, tl.where(e == 0, sub, normal))


@triton.jit
def e2m1_code(v):
    """fp32 -> e2m1 code (uint8, 0..15), round to nearest even onto {0, .5, 1, 1.5, 2, 3, 4, 6},
    saturating at 6; the sign bit follows the input's (so -0.0 and -0.1 give -0, 0x8); NaN gives 0.

    Integer arithmetic on the bit pattern, as e4m3 above (a dozen instructions where a chain of
    seven threshold compares took twice that; nvfp4 is instruction-bound at large T). Normal
    range (``|v| >= 1``): add the RNE bias below the one kept mantissa bit, shift, and rebias the
    exponent (127 - 1 = 126, so the code is ``(bits >> 22) - 252``). Below 1 the codes are
    multiples of 0.5: ``|v| * 2 + 2**23`` rounds to the integer code (0..2) in the fp32 adder.
    """
    bits = v.to(tl.uint32, bitcast=True)
    absb = bits & 0x7FFFFFFF
    normal = ((absb + 0x1FFFFF + ((absb >> 22) & 1)) >> 22) - 252
    sub = (tl.abs(v) * 2.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    code = tl.minimum(tl.where(absb >= 0x3F800000, normal, sub), 7)
    code = code | ((bits >> 28) & 0x8)
    return tl.where(v != v, 0, code).to(tl.uint8)


@triton.jit
def e2m1_code_fma(v):
    """:func:`e2m1_code` for non-NaN ``v`` in half the instructions, as int32 (a NaN ``v``
    gives an unspecified code: callers zero NaN blocks).

    ``a = min(|v|, 6)`` lies in a binade ``[2**e, 2**(e+1))`` (``e >= 0``: below 1 the e2m1 grid
    keeps the spacing 0.5 of [1, 2)), where the grid spacing is ``2**(e-1)``: one fused multiply-add
    ``t = a + 2**e * 2**22`` rounds ``a`` onto that grid with ties to even in the adder (the ulp of
    ``t`` is ``2**(e-1)``, and even multiples of it are the even codes), and ``bits(t)`` minus the
    bits of ``2**(e+22)`` counts grid steps ``k``; the code is ``k + 2e``.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    e_bits = tl.maximum(a.to(tl.int32, bitcast=True), 0x3F800000) & 0x7F800000
    t = tl.fma(e_bits.to(tl.float32, bitcast=True), 4194304.0, a)
    code = t.to(tl.int32, bitcast=True) - e_bits + ((e_bits >> 22) - (254 + (22 << 23)))
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 0x8)


@triton.jit
def ue8m0_round_up(p):
    """Non-negative fp32 ``p`` -> biased E8M0 exponent (uint32) of the smallest power of two >= p.

    Normal p: the exponent field, plus one when any mantissa bit is set. Subnormal p: 2**-127
    (code 0) when p <= 2**-127, else 2**-126 (code 1); p = 0 gives 0. Saturates at 254 (only
    p = inf reaches it); NaN gives 255, E8M0's NaN.
    """
    bits = p.to(tl.uint32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    normal = exp + (man != 0).to(tl.uint32)
    sub = (man > 0x400000).to(tl.uint32)
    e = tl.minimum(tl.where(exp == 0, sub, normal), 254)
    return tl.where(p != p, 255, e).to(tl.uint32)


@triton.jit
def ue8m0_to_inv_scale(e):
    """Biased E8M0 exponent e (0..255, uint32) -> 2**(127 - e) as fp32, exactly; 255 (NaN) -> NaN.

    The biased fp32 exponent is 254 - e; e = 254 gives 2**-127, an fp32 subnormal (0x00400000).
    """
    bits = tl.where(e < 254, (254 - e) << 23, 0x400000)
    return tl.where(e == 255, _F32_NAN_BITS, bits).to(tl.uint32).to(tl.float32, bitcast=True)
