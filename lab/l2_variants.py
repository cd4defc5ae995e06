"""Copies of ``arnorm_triton/_kernels.py`` with other L2 eviction hints, for issue 43.

At TP 1, T 1024, H 8192, bf16, normed output, the bench's graph replay reuses one set of buffers:
arnorm's call touches x (the new residual is written over it), the residual and the normed output
(3 x 16 MiB), FlashInfer's in-place kernel only x and the residual (2 x 16 MiB), against an L2
of 50 MiB. The variants test whether keeping the normed output's stores from evicting the rows the next
call reads closes the gap (lab/gpu_l2_round.sh times them with lab_kernel_variants.py and the
public op's bench). Only hints change: every variant writes the same bytes (the lab checks).

    python3 lab/l2_variants.py arnorm_triton/_kernels.py /tmp/l2var   # prints NAME=PATH ...
"""

from __future__ import annotations

import pathlib
import sys

Y = "tl.store(y_ptr + base + offs, y, mask=mask)"
H = "tl.store(h_ptr + row64 * h_stride + offs, h, mask=mask)"
Q = "tl.store(q_ptr + base + offs, e4m3_bits(yf * tl.div_rn(1.0, scale), SOFT_FP8, False), mask=mask)"
LAST = ', eviction_policy="evict_last"'


def hinted(store: str, policy: str) -> str:
    """``store`` (a ``tl.store(...)`` call) with an eviction policy."""
    return f'{store[:-1]}, eviction_policy="{policy}")'


def replace(src: str, old: str, new: str) -> str:
    if old not in src:
        sys.exit(f"l2_variants: {old!r} not in the kernel source (the kernels changed: update this lab)")
    return src.replace(old, new)


def variants(src: str) -> dict[str, str]:
    """Name -> kernel module source. ``base``: as given; ``yfirst``: the normed output stored
    evict_first; ``yfirst_hlast``: and the new residual evict_last; ``outfirst``: the normed output
    and the fp8_static codes evict_first; ``nolast``: the row and residual loads without their
    evict_last."""
    yfirst = replace(src, Y, hinted(Y, "evict_first"))
    return {
        "base": src,
        "yfirst": yfirst,
        "yfirst_hlast": replace(yfirst, H, hinted(H, "evict_last")),
        "outfirst": replace(yfirst, Q, hinted(Q, "evict_first")),
        "nolast": replace(src, LAST, ""),
    }


def main(argv: list[str]) -> None:
    src, out = pathlib.Path(argv[0]).read_text(), pathlib.Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, text in variants(src).items():
        (out / f"{name}.py").write_text(text)
    print(" ".join(f"{name}={out / name}.py" for name in variants(src)))


if __name__ == "__main__":
    main(sys.argv[1:])
