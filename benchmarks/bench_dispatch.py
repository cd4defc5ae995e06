"""Per-call overhead of ``AllReduceNorm.__call__`` over calling the selected backend directly.

TP 1 on CPU. The backend is replaced by a stub that returns at once, so the figure is arnorm's
own cost (validation, token-count dispatch, the torch.compile check), not the math's. Target:
under 2 microseconds. A second table times a backend with a fast path (the call hands it the data
pointers its test read), with the valid-call test in Python and in arnorm's C helper: the figure
that says whether the C helper still pays for itself. Writes ``benchmarks/results/dispatch-<date>.md``.

    python benchmarks/bench_dispatch.py
"""

from __future__ import annotations

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
    quant: str | None, number: int = 100_000, repeat: int = 7, test: str | None = None
) -> tuple[float, float]:
    """(best op call, direct stub call) in microseconds. ``test``: ``None`` times a backend without
    a fast path; ``"python"`` / ``"c"`` a backend with one, tested in Python or in the C helper."""
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
    op._dispatch.table[1:] = [stub] * (
        len(op._dispatch.table) - 1
    )  # every token count dispatches to the stub
    if test is not None:
        from arnorm.op._accel import accelerator

        op._dispatch.fast_table[1:] = [_fast] * (
            len(op._dispatch.fast_table) - 1
        )  # the list the C state holds too
        op._dispatch.accept = accelerator().accept if test == "c" else None
        if test == "c" and op._dispatch.accept is None:
            raise SystemExit(f"the C helper is not available: {accelerator().reason}")
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
        "A backend with a fast path, the call's test in Python (`Config(accelerate=False)`)"
        " and in the C helper:",
        "",
        "| quant | Python test (us) | C test (us) | the C helper saves (us) |",
        "|---|---:|---:|---:|",
    ]
    for quant in (None, "fp8_static"):
        py, _ = measure(quant, test="python")
        c, _ = measure(quant, test="c")
        lines.append(f"| {quant or 'none'} | {py:.2f} | {c:.2f} | {py - c:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(__file__).parent / "results" / f"dispatch-{date}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
