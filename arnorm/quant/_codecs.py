"""Element codecs: exact rounding of fp32 onto e4m3fn, e2m1 and E8M0, and exact decoding.

Everything works on fp32 bit patterns (``x.view(torch.int32)``) with integer ops, comparisons and
exactly rounded fp32 arithmetic, so the result is the same on every device (no reliance on how a
torch build casts to fp8) and never syncs with the host. The tests check each codec against
``ml_dtypes`` on every rounding boundary and its fp32 neighbours.

Conventions shared by all encoders:

* round to nearest, ties to even (RNE), saturating: finite values and infinities beyond the
  largest finite code encode as that code (e4m3fn: +-448, e2m1: +-6), with their sign;
* the sign of zero is kept (``-0.0`` and negative values that round to zero give the ``-0`` code);
* NaN, whatever its sign or payload, gives e4m3fn ``0x7F``; e2m1 has no NaN and NaN gives ``0x0``
  (callers make the block's scale NaN, so the block still decodes to NaN).
"""

from __future__ import annotations

import struct

import torch

__all__ = [
    "E4M3_MAX",
    "E4M3_NAN",
    "F32_RCP_6",
    "F32_RCP_448",
    "F32_MIN_TOKEN_SCALE",
    "E8M0_NAN",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "e8m0_decode",
    "f32_from_bits",
    "pow2_neg_e8m0",
    "ue8m0_round_up",
]


def f32_from_bits(bits: int) -> float:
    """The fp32 value with bit pattern ``bits``, as a Python float (exact)."""
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


#: Largest finite e4m3fn value.
E4M3_MAX = 448.0
#: The e4m3fn NaN code every NaN encodes to.
E4M3_NAN = 0x7F
#: The E8M0 NaN code (a block containing NaN).
E8M0_NAN = 0xFF
#: fp32(1/6), the fp32 nearest to 1/6 (0x3E2AAAAB); equal to CUDA's ``rcp.approx(6.0f)``.
F32_RCP_6 = f32_from_bits(0x3E2AAAAB)
#: fp32(1/448), the fp32 nearest to 1/448 (0x3B124925); equal to CUDA's ``rcp.approx(448.0f)``.
F32_RCP_448 = f32_from_bits(0x3B124925)
#: fp32(1/(448*512)) (0x36924925), the floor of the fp8_per_token scale.
F32_MIN_TOKEN_SCALE = f32_from_bits(0x36924925)

_F32_448_BITS = 0x43E00000  # 448.0
_F32_MIN_E4M3_NORMAL_BITS = 121 << 23  # 2**-6
_F32_EXP_MASK = 0x7F800000
_F32_TWO_POW_23 = 8388608.0
_F32_TWO_POW_23_BITS = 0x4B000000


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"expected a float32 tensor, got {x.dtype}")
    return x.view(torch.int32)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn codes (``uint8``): RNE, saturating to +-448, signed zeros kept, NaN -> 0x7F."""
    bits = _bits(x)
    sign = (bits >> 24) & 0x80
    absb = bits & 0x7FFFFFFF
    is_nan = absb > _F32_EXP_MASK
    # Saturate first: everything above 448 (inf included) becomes 448; this also keeps the integer
    # rounding below from overflowing.
    sat = torch.clamp(absb, max=_F32_448_BITS)
    # Normal e4m3 range [2**-6, 448]: round the fp32 mantissa to 3 bits (RNE at bit 20) and rebias
    # the exponent from 127 to 7; a mantissa carry correctly bumps the exponent.
    normal = ((sat + ((sat >> 20) & 1) + 0x7FFFF) >> 20) - (120 << 3)
    # Subnormal range (< 2**-6): the code is RNE(|x| * 2**9), 0..8 (8 is the smallest normal).
    # |x| * 512 is exact (a power-of-two scaling that cannot overflow), and adding 2**23 rounds it
    # to an integer with one IEEE round-to-nearest-even (the sum lies in [2**23, 2**24)); an FMA
    # contraction gives the same bits because the product is exact.
    scaled = sat.view(torch.float32) * 512.0 + _F32_TWO_POW_23
    sub = scaled.view(torch.int32) - _F32_TWO_POW_23_BITS
    code = torch.where(sat < _F32_MIN_E4M3_NORMAL_BITS, sub, normal) | sign
    code = torch.where(is_nan, E4M3_NAN, code)
    return code.to(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (``uint8`` or ``float8_e4m3fn``) -> fp32, exact (0x7F/0xFF -> NaN)."""
    if codes.dtype != torch.float8_e4m3fn:
        codes = codes.view(torch.float8_e4m3fn)
    return codes.to(torch.float32)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes 0..15 (``uint8``, one per element, sign in bit 3).

    RNE onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}: a tie goes to the even code, so 0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; above 5 (inf included) saturates to 6. The
    comparisons are exact, so this is the correctly rounded result. NaN -> 0x0.
    """
    bits = _bits(x)
    a = x.abs()
    idx = (a > 0.25).to(torch.uint8)
    idx += a >= 0.75
    idx += a > 1.25
    idx += a >= 1.75
    idx += a > 2.5
    idx += a >= 3.5
    idx += a > 5.0
    negative = (bits < 0) & ~torch.isnan(x)
    return idx | (negative.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 (``uint8``) -> fp32, exact (code 8 is -0.0)."""
    c = codes.to(torch.int32)
    exp = (c >> 1) & 3
    man = c & 1
    # value * 4: exponent 0 is subnormal (0 or 0.5); otherwise (1 + man/2) * 2**(exp - 1).
    quarters = torch.where(exp == 0, man * 2, (man + 2) << exp)
    value = quarters.to(torch.float32) * 0.25
    return torch.where((c & 8) != 0, -value, value)


def ue8m0_round_up(p: torch.Tensor) -> torch.Tensor:
    """fp32 ``p >= 0`` -> biased E8M0 exponent (``int32``): the smallest E8M0 value ``>= p``.

    E8M0 holds 2**(e - 127) for e in 0..254 (255 is NaN). So ``e = ceil(log2 p) + 127`` for normal
    ``p``; every ``p <= 2**-127`` (zero, and fp32 subnormals up to 2**-127) gives the smallest value
    2**-127, ``e = 0``; subnormals in (2**-127, 2**-126) give 2**-126, ``e = 1``. Results above 254
    (only ``p = inf``) saturate to 254; NaN gives 255.
    """
    bits = _bits(p)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    is_nan = (exp == 0xFF) & (man != 0)
    e = torch.where(exp == 0, (man > 0x400000).to(torch.int32), exp + (man != 0).to(torch.int32))
    e = torch.clamp(e, max=254)
    return torch.where(is_nan, E8M0_NAN, e)


def _pow2_from_biased(k: torch.Tensor) -> torch.Tensor:
    """2**(k - 127) as fp32 for integer ``k`` in 0..254 (k = 0 is the subnormal 2**-127), exact."""
    bits = torch.where(k == 0, 0x00400000, k << 23)
    return bits.to(torch.int32).view(torch.float32)


def e8m0_decode(e: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents (any integer dtype, 0..255) -> fp32 2**(e - 127); 255 -> NaN."""
    k = e.to(torch.int32)
    value = _pow2_from_biased(torch.clamp(k, max=254))
    return torch.where(k == E8M0_NAN, float("nan"), value)


def pow2_neg_e8m0(e: torch.Tensor) -> torch.Tensor:
    """The encode multiplier 2**(127 - e) as fp32 for biased exponents ``e`` 0..254 (exact); 255 -> NaN."""
    k = e.to(torch.int32)
    value = _pow2_from_biased(254 - torch.clamp(k, max=254))
    return torch.where(k == E8M0_NAN, float("nan"), value)
