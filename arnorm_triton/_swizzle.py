"""The second pass of a two-pass block-scale store (nvfp4 at large T; the launch table says when).

The fused kernel (:mod:`arnorm_triton._kernels`, ``SWIZZLED=False``) writes a call's block scales
linearly into a scratch buffer; :func:`swizzle_block_scales_kernel` moves them into the
``swizzled_128x4`` layout with whole-tile stores (why: see the kernel's docstring). The bytes are
those the fused kernel writes when it swizzles them itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["SWIZZLE_WARPS", "swizzle_block_scales_kernel", "swizzle_shape", "swizzle_tile_chunk"]

#: Warps per program of :func:`swizzle_block_scales_kernel`.
SWIZZLE_WARPS = 4


@triton.jit(do_not_specialize=["n_rows"])
def swizzle_block_scales_kernel(src_ptr, sf_ptr, n_rows, K: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                                USE_PDL: tl.constexpr):  # fmt: skip
    """The second pass of a two-pass store: block scales ``src`` (uint8 ``[T, K]``, linear, as the
    fused kernel wrote them with ``SWIZZLED=False``) into ``sf``'s ``swizzled_128x4`` layout
    (``[round_up(T, 128), KP]``, ``KP = round_up(K, 4)``), padding rows and columns zeroed.

    Why: a row's 4 bytes of every 512-byte tile are a partial-sector write each (128 of them per
    row at H 8192), which at large T costs the fused kernel 7-9% of its bandwidth; here one
    program owns whole tiles and stores them contiguously. Program ``(t, c)``: rows
    ``[128 t, 128 t + 128)``, columns ``[KC c, KC c + KC)``, whose swizzled bytes are one contiguous
    run of ``KC * 128`` (the column groups ``k // 4`` are the outermost term of the offset).
    """
    if USE_PDL:  # the fused kernel's stores of src must have landed
        tl.extra.cuda.gdc_wait()
    swizzle_tile_chunk(src_ptr, sf_ptr, n_rows, tl.program_id(0), tl.program_id(1), K, KP, KC)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def swizzle_tile_chunk(src_ptr, sf_ptr, n_rows, tile, chunk, K: tl.constexpr, KP: tl.constexpr,
                       KC: tl.constexpr):  # fmt: skip
    """The work of program ``(tile, chunk)`` of :func:`swizzle_block_scales_kernel`, which must have
    waited for ``src``: load the chunk's ``[128, KC]`` linear scales, store them swizzled."""
    rows = tile * 128 + tl.arange(0, 128)
    cols = chunk * KC + tl.arange(0, KC)
    v = tl.load(src_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                mask=(rows[:, None] < n_rows) & (cols[None, :] < K), other=0)  # fmt: skip
    # [m, k] -> [m // 32, m % 32, k // 4, k % 4] -> [k // 4, m % 32, m // 32, k % 4], row-major: the
    # swizzle (k // 4) * 512 + (m % 32) * 16 + (m // 32) * 4 + k % 4 within the tile.
    flat = tl.reshape(tl.permute(tl.reshape(v, [4, 32, KC // 4, 4]), [2, 1, 0, 3]), [KC * 128])
    o = tl.arange(0, KC * 128)
    base = tile.to(tl.int64) * (KP // 4 * 512) + chunk * (KC // 4 * 512)
    tl.store(sf_ptr + base + o, flat, mask=o < (KP - chunk * KC) * 128)


def swizzle_shape(k: int, kc_max: int = 64) -> tuple[int, int, int]:
    """``(KP, KC, chunks)`` of :func:`swizzle_block_scales_kernel` for ``k`` scale columns: the padded
    columns, the columns per program (a power of two >= 4, at most ``kc_max``), and programs per
    tile (the grid is ``(round_up(T, 128) // 128, chunks)``)."""
    kp = (k + 3) // 4 * 4
    kc = min(kc_max, max(4, triton.next_power_of_2(kp)))
    return kp, kc, (kp + kc - 1) // kc
