"""Eager calls of the public op at large T, nvfp4 with swizzled scales: the launch table's store
(two passes from T 4096) against one pass forced, on one CUDA GPU.

    python3 lab/check_two_pass_eager.py

Prints a markdown table: per (H, normed output, T) and store mode, whether the call went through
the direct launch (``fast``), whether its codes and scales equal the first mode's (``same``), and
microseconds per call over 50 eager calls followed by one synchronization (the GPU's time when the
host keeps up, which is what an engine without CUDA graphs gets at these sizes).
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    import torch

    import arnorm

    if not torch.cuda.is_available():
        print("check_two_pass_eager: needs a CUDA GPU", file=sys.stderr)
        return 2
    print("| H | normed | T | config | eager us/call (50 calls, then sync) |")
    print("|---:|---|---:|---|---:|")
    for h in (4096, 8192):
        for normed in (False, True):
            for t in (4096, 8192):
                g = torch.Generator(device="cuda").manual_seed(t)
                x = torch.randn((t, h), generator=g, device="cuda").to(torch.bfloat16)
                r, w = torch.randn_like(x), torch.ones(h, dtype=torch.bfloat16, device="cuda")
                s = torch.tensor([336.0], device="cuda")
                op = arnorm.AllReduceNorm(
                    arnorm.LOCAL, hidden_size=h, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6),
                    quant="nvfp4", scale_layout="swizzled_128x4", max_tokens=t, normed_output=normed,
                    device="cuda",
                )  # fmt: skip
                launcher = op._dispatch.table[t].launcher  # private: the store mode is the launcher's
                ref = None
                for two in (None, False):
                    launcher.fixed_two_pass = two
                    launcher._by_rows.clear()
                    out = op(x.clone(), r, w, s)
                    got = [out.quant.data.clone(), out.quant.scale.clone()]
                    ref = got if ref is None else ref
                    same = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
                    xs = x.clone()
                    for _ in range(5):
                        op(xs, r, w, s)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(50):
                        op(xs, r, w, s)
                    torch.cuda.synchronize()
                    us = (time.perf_counter() - t0) / 50 * 1e6
                    cfg = launcher.config(t)
                    # fast: this configuration has a bound direct launcher (not just some other one)
                    mode = f"two_pass={cfg.two_pass} fast={cfg in launcher._bound} same={same}"
                    print(f"| {h} | {normed} | {t} | {mode} | {us:.1f} |")
                op.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
