"""The fused kernel: (rank-order sum) + residual add + RMSNorm + quantization, one row per program.

Per row ``t`` (``H`` = hidden size, ``D`` = the dtype, ``W`` = ``NUM_PARTIALS``; DESIGN.md,
"Numerics contract")::

    s   = D(sum_{r<W} fp32(x[r, t]))              # W = 1: x is the already all-reduced sum
    h   = D(fp32(s) + fp32(res[t]))               -> h_ptr (the new residual)
    y   = D(fp32(h) * (1 / sqrt_rn(sum(fp32(h)**2) / H + eps)) * (fp32(w) + weight_offset))
                                                  -> y_ptr (when WRITE_NORMED)
    q   = Q(fp32(y))                              -> q_ptr (codes, uint8), sf_ptr (scales)

Every division and the square root are IEEE round-to-nearest (``tl.div_rn``, ``tl.sqrt_rn``):
Triton's ``/`` lowers to ``div.full.f32`` (about 2 ulp) on NVIDIA GPUs, which would break the
bit-exact quantizer contract. The row lives in registers as ``[BLOCK // GROUP, GROUP]``: one
block of ``GROUP`` elements per quantization block (16 for nvfp4, 32 for mxfp8, 16 otherwise), so
block amaxes are row reductions with no reshape. ``BLOCK = max(next_pow2(H), 4 * GROUP)``; lanes
at or beyond ``H`` are masked and load as zero.

Quantized outputs (``QUANT``: 0 none, 1 fp8_static, 2 fp8_per_token, 3 nvfp4, 4 mxfp8), all
stored as bytes so the kernel never needs an fp8 pointer type:

- fp8 (1, 2) and mxfp8 (4): e4m3 codes ``[T, H]``; per-token scales fp32 ``[T]``.
- nvfp4: e2m1 pairs ``[T, H/2]``, low nibble first; e4m3 block scales.
- nvfp4 / mxfp8 block scales: ``linear`` ``[T, K]`` or ``swizzled_128x4``
  ``[round_up(T, 128), round_up(K, 4)]`` (K = H / GROUP). In the swizzled layout each row program
  also writes its padding columns, and up to 4 extra programs zero the padding rows (``>= T``), so
  the output needs no memset.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from arnorm_triton._casts import (
    E4M3_MAX,
    abs_max,
    e2m1_code,
    e4m3_bits,
    e4m3_decode,
    to_dtype_rne,
    to_fp32,
    ue8m0_round_up,
    ue8m0_to_inv_scale,
)
from arnorm_triton._plugin import MAX_HIDDEN

if TYPE_CHECKING:
    import torch

__all__ = [
    "INTERPRETED",
    "MAX_HIDDEN",
    "QUANT_CODES",
    "FusedLauncher",
    "default_num_warps",
    "fused_add_rmsnorm_quant_kernel",
]

_log = logging.getLogger("arnorm.triton")

#: Swizzled scale padding rows zeroed per extra program.
PAD_ROWS_PER_PROGRAM = tl.constexpr(32)
#: Quant format -> the kernel's ``QUANT`` constexpr.
QUANT_CODES: dict[str | None, int] = {None: 0, "fp8_static": 1, "fp8_per_token": 2, "nvfp4": 3, "mxfp8": 4}


def _f32(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


#: fp32(1/6), fp32(1/448) and the per-token scale floor fp32(1/(448*512)), given by their bits so
#: no literal rounding is involved (the same constants as arnorm.quant's).
_INV_E2M1_MAX = tl.constexpr(_f32(0x3E2AAAAB))
_INV_E4M3_MAX = tl.constexpr(_f32(0x3B124925))
_MIN_TOKEN_SCALE = tl.constexpr(_f32(0x36924925))


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
def _zero_padding_rows(sf_ptr, pad_program, n_rows, NB: tl.constexpr, K: tl.constexpr):
    """Zero the swizzled scale rows [T + 32 p, T + 32 p + 32) that lie below round_up(T, 128)."""
    KP: tl.constexpr = (K + 3) // 4 * 4
    rows = n_rows + pad_program * PAD_ROWS_PER_PROGRAM + tl.arange(0, PAD_ROWS_PER_PROGRAM)[:, None]
    blk = tl.arange(0, NB)[None, :]
    mask = (rows < (n_rows + 127) // 128 * 128) & (blk < KP)
    tl.store(
        sf_ptr + _swizzled_offset(rows, blk, KP), tl.zeros([PAD_ROWS_PER_PROGRAM, NB], tl.uint8), mask=mask
    )


@triton.jit
def _fused_row(
    x_ptr, res_ptr, w_ptr, scale_ptr, h_ptr, y_ptr, q_ptr, sf_ptr, row, n_rows, eps, weight_offset,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, NUM_PARTIALS: tl.constexpr,
    QUANT: tl.constexpr, SWIZZLED: tl.constexpr, WRITE_NORMED: tl.constexpr,
    SOFT: tl.constexpr, SOFT_FP8: tl.constexpr,
):  # fmt: skip
    """Steps 1-4 for data row ``row`` (see the module docstring)."""
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    NB: tl.constexpr = BLOCK // GROUP
    blk = tl.arange(0, NB)
    offs = blk[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < HIDDEN
    base = row.to(tl.int64) * HIDDEN

    # Step 1: s. Exact mode sums the gathered partials in fp32 from rank 0 up, one rounding to D.
    acc = to_fp32(tl.load(x_ptr + base + offs, mask=mask, other=0.0), SOFT)
    if NUM_PARTIALS > 1:
        stride = n_rows.to(tl.int64) * HIDDEN
        for r in tl.static_range(1, NUM_PARTIALS):
            acc = acc + to_fp32(tl.load(x_ptr + r * stride + base + offs, mask=mask, other=0.0), SOFT)
        acc = to_fp32(to_dtype_rne(acc, DTYPE, SOFT), SOFT)

    # Step 2: h = D(s + res), rounded before the statistic (the contract's order).
    h = to_dtype_rne(acc + to_fp32(tl.load(res_ptr + base + offs, mask=mask, other=0.0), SOFT), DTYPE, SOFT)
    tl.store(h_ptr + base + offs, h, mask=mask)
    hf = to_fp32(h, SOFT)

    # Step 3: y, with a correctly rounded mean, square root and reciprocal.
    mean_sq = tl.div_rn(tl.sum(tl.sum(hf * hf, axis=1), axis=0), HIDDEN * 1.0)
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    w = to_fp32(tl.load(w_ptr + offs, mask=mask, other=0.0), SOFT)
    y = to_dtype_rne((hf * inv_rms) * (w + weight_offset), DTYPE, SOFT)
    if WRITE_NORMED:
        tl.store(y_ptr + base + offs, y, mask=mask)
    yf = to_fp32(y, SOFT)

    # Step 4: the quantizer reads the D-rounded y; amaxes propagate NaN as torch's amax does.
    if QUANT == 1:  # fp8_static: satfinite_rn(y * fp32(1 / scale))
        inv_scale = tl.div_rn(1.0, tl.load(scale_ptr))
        tl.store(q_ptr + base + offs, e4m3_bits(yf * inv_scale, SOFT_FP8), mask=mask)
    elif QUANT == 2:  # fp8_per_token: scale_t = max(amax_t / 448, 1 / (448 * 512)), q = y / scale_t
        amax = abs_max(abs_max(yf, 1), 0)
        tok_scale = tl.maximum(tl.div_rn(amax, E4M3_MAX), _MIN_TOKEN_SCALE, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + base + offs, e4m3_bits(tl.div_rn(yf, tok_scale), SOFT_FP8), mask=mask)
        tl.store(sf_ptr + row, tok_scale)
    elif QUANT == 3:  # nvfp4: SF = e4m3(gs * (amax16 * fp32(1/6))), q = e2m1(y * (gs / SF))
        gs = tl.load(scale_ptr)
        sf_code = e4m3_bits(gs * (abs_max(yf, 1) * _INV_E2M1_MAX), SOFT_FP8)
        sf = e4m3_decode(sf_code)
        enc = tl.where(sf == 0.0, 0.0, tl.div_rn(gs, tl.where(sf == 0.0, 1.0, sf)))
        lo, hi = tl.split(tl.reshape(e2m1_code(yf * enc[:, None]), [NB, GROUP // 2, 2]))
        poffs = blk[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        pbase = row.to(tl.int64) * (HIDDEN // 2)
        tl.store(q_ptr + pbase + poffs, lo | (hi << 4), mask=poffs < HIDDEN // 2)
        _store_block_scales(sf_ptr, sf_code, row, blk, HIDDEN // GROUP, SWIZZLED)
    elif QUANT == 4:  # mxfp8: e = ue8m0_round_up(amax32 * fp32(1/448)), q = e4m3(y * 2**(127 - e))
        e = ue8m0_round_up(abs_max(yf, 1) * _INV_E4M3_MAX)
        tl.store(q_ptr + base + offs, e4m3_bits(yf * ue8m0_to_inv_scale(e)[:, None], SOFT_FP8), mask=mask)
        _store_block_scales(sf_ptr, e, row, blk, HIDDEN // GROUP, SWIZZLED)


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
    n_rows,  # T: rows with data; the swizzled grid has round_up(T, 128) programs
    eps,  # fp32
    weight_offset,  # fp32: 0 plain, 1 Gemma
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_PARTIALS: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    SOFT: tl.constexpr,  # integer-bit bf16 rounding (the interpreter)
    SOFT_FP8: tl.constexpr,  # integer-bit e4m3 rounding (interpreter, pre-SM89, ROCm)
):
    """One program per row; with swizzled block scales, ``ceil((round_up(T, 128) - T) / 32)`` more
    programs zero the padding rows of the last 128-row tile, 32 rows each."""
    row = tl.program_id(0)
    if SWIZZLED:
        if row < n_rows:
            _fused_row(x_ptr, res_ptr, w_ptr, scale_ptr, h_ptr, y_ptr, q_ptr, sf_ptr, row, n_rows, eps,
                       weight_offset, HIDDEN, BLOCK, GROUP, NUM_PARTIALS, QUANT, SWIZZLED, WRITE_NORMED, SOFT,
                       SOFT_FP8)  # fmt: skip
        else:
            _zero_padding_rows(sf_ptr, row - n_rows, n_rows, BLOCK // GROUP, HIDDEN // GROUP)
    else:
        _fused_row(x_ptr, res_ptr, w_ptr, scale_ptr, h_ptr, y_ptr, q_ptr, sf_ptr, row, n_rows, eps,
                   weight_offset, HIDDEN, BLOCK, GROUP, NUM_PARTIALS, QUANT, SWIZZLED, WRITE_NORMED, SOFT,
                   SOFT_FP8)  # fmt: skip


def default_num_warps(block: int) -> int:
    """Warps per row program: 8 to 16 elements per thread (4 warps up to 1024 lanes, 8 up to 4096,
    16 at 8192, 32 at 16384). ptxas (SM 90) then needs 26-49 registers per thread for every format,
    with no spills, which keeps 32 or more warps resident per SM for the loads in flight.

    Fixed by the hidden size only, never tuned per rank: the warp count changes the order of the
    sum of squares, and TP ranks must produce identical normed values.
    """
    if block >= 16384:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


class FusedLauncher:
    """Launches of the fused kernel for one op, with every constexpr and launch parameter bound once.

    ``launch(x, res, w, scale, h, y, q, sf, n_rows)`` takes the pointers in the kernel's order;
    unused pointers must still be tensors (pass any, e.g. ``h``) so the signature is stable.

    Launch overhead: ``kernel[grid](...)`` re-binds and re-specializes every argument in Python
    (tens of microseconds per call, more than the kernel at decode sizes). After
    :meth:`enable_fast_path` the launcher instead calls the compiled kernel's C launcher directly
    with the pre-bound constexprs, exactly as ``JITFunction.run`` ends (the same call in Triton 3.6
    and 3.8; setup checks it bit for bit and falls back to ``kernel[grid]`` where it differs). The
    fast path is used only when the specialization it was compiled for
    still holds: the data pointers are 16-byte aligned (Triton specializes on that) and no launch
    hook (profiler) is installed; anything else takes the ordinary path. A CUDA-graph-captured
    call costs neither.
    """

    def __init__(
        self,
        *,
        hidden: int,
        quant: str | None,
        layout: str | None,
        write_normed: bool,
        num_partials: int,
        eps: float,
        weight_offset: float,
        soft: bool,
        soft_fp8: bool,
        num_warps: int | None = None,
    ) -> None:
        if hidden > MAX_HIDDEN:
            msg = f"hidden size: {hidden} (needs <= {MAX_HIDDEN})"
            raise ValueError(msg)
        group = 32 if quant == "mxfp8" else 16
        block = max(triton.next_power_of_2(hidden), 4 * group)
        self.quant = quant
        self.swizzled = layout == "swizzled_128x4" and quant in ("nvfp4", "mxfp8")
        self.num_warps = num_warps or default_num_warps(block)
        self.eps = float(eps)
        self.weight_offset = float(weight_offset)
        self.constexprs: dict[str, Any] = {
            "HIDDEN": hidden,
            "BLOCK": block,
            "GROUP": group,
            "NUM_PARTIALS": num_partials,
            "QUANT": QUANT_CODES[quant],
            "SWIZZLED": self.swizzled,
            "WRITE_NORMED": write_normed,
            "SOFT": soft,
            "SOFT_FP8": soft_fp8,
        }
        names = fused_add_rmsnorm_quant_kernel.arg_names
        self._const_tail = tuple(self.constexprs[n] for n in names[names.index("HIDDEN") :])
        self._fast: tuple[Callable[..., Any], Any, Any, Callable[[int], int], int] | None = None

    def grid_rows(self, n_rows: int) -> int:
        """Programs to launch: T, plus one per 32 padding rows when swizzled scales need them."""
        if not self.swizzled:
            return n_rows
        return n_rows + ((n_rows + 127) // 128 * 128 - n_rows + 31) // 32

    def launch(self, *ptrs: torch.Tensor, n_rows: int) -> Any:
        """One launch over ``n_rows`` rows; ``ptrs`` = x, res, w, scale, h, y, q, sf."""
        if (
            self._fast is not None
            and not (ptrs[0].data_ptr() | ptrs[1].data_ptr() | ptrs[2].data_ptr() | ptrs[4].data_ptr()) & 15
            and not _launch_hooks_active()
        ):
            self._direct(ptrs, n_rows)
            return None
        return fused_add_rmsnorm_quant_kernel[(self.grid_rows(n_rows),)](
            *ptrs, n_rows, self.eps, self.weight_offset, num_warps=self.num_warps, **self.constexprs
        )

    def _direct(self, ptrs: tuple[torch.Tensor, ...], n_rows: int) -> None:
        """The compiled kernel's C launcher, called as ``JITFunction.run`` calls it (no hooks)."""
        assert self._fast is not None
        run, function, packed, get_stream, device = self._fast
        args = (*ptrs, n_rows, self.eps, self.weight_offset, *self._const_tail)
        run(self.grid_rows(n_rows), 1, 1, get_stream(device), function, packed, None, None, None, *args)

    def enable_fast_path(
        self, ptrs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...], n_rows: int
    ) -> bool:
        """Compile through ``kernel[grid]``, bind the C launcher, and keep it only if a launch
        through it writes ``outputs`` bit for bit as the ordinary launch did. Synchronizes: setup only.

        ``ptrs`` must not alias (x and h distinct) so that the two launches see the same inputs,
        and must be 16-byte aligned like every tensor torch allocates.
        """
        self._fast = None
        if INTERPRETED:
            return False
        try:
            import torch
            from triton.runtime import driver

            compiled = self.launch(*ptrs, n_rows=n_rows)
            first = [o.clone() for o in outputs]
            dev = ptrs[0].device
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            get_stream = driver.active.get_current_stream
            self._fast = (compiled.run, compiled.function, compiled.packed_metadata, get_stream, index)
            for o in outputs:
                o.zero_()
            self._direct(ptrs, n_rows)
            torch.cuda.synchronize(dev)
            pairs = zip(first, outputs, strict=True)
            if all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs):
                return True
            _log.warning("triton: direct launch disagrees with kernel[grid]; using kernel[grid]")
        except Exception as exc:  # any Triton API drift: fall back, never fail setup over speed
            _log.warning(
                "triton: direct launch unavailable (%s: %s); using kernel[grid]", type(exc).__name__, exc
            )
        self._fast = None
        return False

    @property
    def fast(self) -> bool:
        """Whether launches go straight to the compiled kernel's C launcher."""
        return self._fast is not None


#: ``triton.knobs`` (Triton >= 3.4), read per fast launch: a profiler's launch hook needs the slow path.
_KNOBS: Any = getattr(triton, "knobs", None)


def _launch_hooks_active() -> bool:
    """Whether a launch-enter hook (a profiler such as proton) is installed. Since Triton 3.5 the
    knob is a ``HookChain`` that is never ``None``; an empty chain means no hook."""
    if _KNOBS is None:
        return False
    hook = _KNOBS.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def is_interpreted() -> bool:
    """Whether this module's kernels were built by the Triton interpreter (``TRITON_INTERPRET=1``
    when the module was first imported: Triton reads it in the ``@triton.jit`` decorator)."""
    return not hasattr(fused_add_rmsnorm_quant_kernel, "device_caches")


INTERPRETED: bool = is_interpreted()
