"""Per-call overhead of ``AllReduceNorm.__call__`` over calling the selected backend directly.

TP 1 on CPU. The backend is replaced by a stub that returns at once, so the figure is arnorm's
own cost (validation, token-count dispatch, the torch.compile check), not the math's. Target:
under 2 microseconds. A second table times a backend with a fast path (the call hands it the data
pointers its test read). Writes ``benchmarks/results/dispatch-<date>.md``.

    python benchmarks/bench_dispatch.py
"""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
import platform
import timeit

import torch

import arnorm


class _Stub:
    def __call__(self, hidden_states, residual, weight, scale):
        return None

    def check_tokens(self, num_tokens):
        return ()


_DONE = object()


def _fast(t, hidden_states, residual, weight, scale, out, hp, rp, wp, sp):
    return _DONE


def measure(
    quant: str | None, number: int = 100_000, repeat: int = 7, fast: bool = False
) -> tuple[float, float]:
    """(best op call, direct stub call) in microseconds; ``fast``: the backend has a fast path."""
    h = 4096
    op = arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=h,
        dtype=torch.bfloat16,
        norm=arnorm.RMSNorm(),
        quant=quant,
        max_tokens=64,
        device="cpu",
        backend="reference",
    )
    x, r = torch.randn(8, h, dtype=torch.bfloat16), torch.randn(8, h, dtype=torch.bfloat16)
    w = torch.randn(h, dtype=torch.bfloat16)
    s = torch.ones(1) if quant == "fp8_static" else None
    stub = _Stub()
    # Every token count dispatches to the stub (private: the plan is replaced whole, as poisoning
    # does), whose results count as checked already.
    n = len(op._plan.table)
    changes = {"table": (None,) + (stub,) * (n - 1)}
    if fast:
        changes["fast_table"] = (None,) + (_fast,) * (n - 1)
    op._plan = dataclasses.replace(op._plan, **changes)
    op._state.checked[:] = op._state.fast_checked[:] = [True] * n
    if fast:
        assert op(x, r, w, s) is _DONE

    def via_op():
        op(x, r, w, s)

    def direct():
        stub(x, r, w, s)

    t_op = min(timeit.repeat(via_op, number=number, repeat=repeat)) / number * 1e6
    t_direct = min(timeit.repeat(direct, number=number, repeat=repeat)) / number * 1e6
    return t_op, t_direct


def main() -> None:
    rows = []
    for quant in (None, "fp8_static"):
        t_op, t_direct = measure(quant)
        rows.append((quant or "none", t_op, t_direct, t_op - t_direct))
    date = datetime.date.today().isoformat()
    lines = [
        f"# Dispatch overhead of AllReduceNorm.__call__ ({date})",
        "",
        f"CPU: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
        f"torch {torch.__version__}; TP 1, T=8, H=4096, bf16; backend replaced by a no-op stub; "
        "best of 7 runs of 100,000 calls.",
        "",
        "| quant | op call (us) | direct stub call (us) | overhead (us) | target |",
        "|---|---:|---:|---:|---|",
    ]
    for q, a, b, d in rows:
        lines.append(f"| {q} | {a:.2f} | {b:.2f} | {d:.2f} | {'met' if d < 2 else 'MISSED'} (< 2 us) |")
    lines += [
        "",
        "A backend with a fast path (the call hands it the data pointers its test read):",
        "",
        "| quant | op call (us) |",
        "|---|---:|",
    ]
    for quant in (None, "fp8_static"):
        t_fast, _ = measure(quant, fast=True)
        lines.append(f"| {quant or 'none'} | {t_fast:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(__file__).parent / "results" / f"dispatch-{date}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
