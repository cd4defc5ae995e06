"""Per-call overhead of ``AllReduceNorm.__call__`` over calling the selected backend directly.

TP 1 on CPU. The op's backend is a stub that returns at once (registered for the run through
``arnorm.testing.registered``, selected like any plugin), so the figure is arnorm's own cost
(validation, token-count dispatch, the torch.compile check), not the math's. Target: under 2
microseconds. A second table times a stub with a fast path (``fast_path()``, which the call hands
the data pointers its check read). Writes ``benchmarks/results/dispatch-<date>.md``.

    python benchmarks/bench_dispatch.py
"""

from __future__ import annotations

import datetime
import importlib
import pathlib
import platform
import timeit

import torch

import arnorm
from arnorm.plugin import BackendSpec, Capabilities, Output, empty_quantized
from arnorm.testing import registered

_CAPS = Capabilities(platforms=frozenset({"cpu"}), quant=frozenset({"none", "fp8_static"}))
#: Calls the fast path served (the op must choose it over ``__call__`` for a valid call).
FAST_CALLS = [0]


class StubBackend:
    """Does no work: its outputs are allocated once per token count and handed back, the new
    residual being ``hidden_states`` itself (in place). What the op costs around a backend."""

    name = "dispatch_stub"

    def __init__(self, problem):
        self.problem = problem
        self._outputs = {}

    @classmethod
    def probe(cls, problem):
        return ()

    @classmethod
    def create(cls, problem, comm, settings):
        return cls(problem)

    def check_tokens(self, num_tokens):
        return ()

    def __call__(self, hidden_states, residual, weight, scale, out=None):
        t = hidden_states.shape[0]
        normed, q = self._outputs.get(t) or self._allocate(hidden_states, scale)
        return Output(normed, hidden_states, q)

    def _allocate(self, hidden_states, scale):
        p, t = self.problem, hidden_states.shape[0]
        normed = torch.empty_like(hidden_states) if p.normed_output else None
        q = None
        if p.quant is not None:
            q = empty_quantized(p.quant, t, p.hidden_size, device=hidden_states.device, scale=scale)
        self._outputs[t] = (normed, q)
        return normed, q

    def close(self):
        self._outputs.clear()


class FastStubBackend(StubBackend):
    """The same with a fast path, which the op calls instead of ``__call__`` for a valid call."""

    name = "dispatch_stub_fast"

    def fast_path(self):
        def fast(t, hidden_states, residual, weight, scale, out, hp, rp, wp, sp):
            FAST_CALLS[0] += 1
            return self(hidden_states, residual, weight, scale)

        return fast


#: Registered for the run only; priority below the reference's, and asked for by name.
SPECS = (
    BackendSpec(name="dispatch_stub", priority=-100, capabilities=_CAPS, loader="bench_dispatch:StubBackend"),
    BackendSpec(
        name="dispatch_stub_fast",
        priority=-100,
        capabilities=_CAPS.model_copy(update={"caller_outputs": True}),
        loader="bench_dispatch:FastStubBackend",
    ),
)


def measure(quant: str | None, backend: str, number: int = 100_000, repeat: int = 7) -> tuple[float, float]:
    """(best op call, direct stub call) in microseconds."""
    h = 4096
    op = arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=h,
        dtype=torch.bfloat16,
        norm=arnorm.RMSNorm(),
        quant=quant,
        max_tokens=64,
        device="cpu",
        backend=backend,
    )
    x, r = torch.randn(8, h, dtype=torch.bfloat16), torch.randn(8, h, dtype=torch.bfloat16)
    w = torch.randn(h, dtype=torch.bfloat16)
    s = torch.ones(1) if quant == "fp8_static" else None
    stub = StubBackend(op.problem)
    # The registered loader imports this file as the module bench_dispatch: its counter is that
    # module's (not __main__'s when the file runs as a script).
    calls = importlib.import_module("bench_dispatch").FAST_CALLS
    before = calls[0]
    op(x, r, w, s)
    if backend == "dispatch_stub_fast":
        assert calls[0] == before + 1, "the fast path did not serve the call"

    def via_op():
        op(x, r, w, s)

    def direct():
        stub(x, r, w, s)

    t_op = min(timeit.repeat(via_op, number=number, repeat=repeat)) / number * 1e6
    t_direct = min(timeit.repeat(direct, number=number, repeat=repeat)) / number * 1e6
    op.close()
    return t_op, t_direct


def main() -> None:
    date = datetime.date.today().isoformat()
    lines = [
        f"# Dispatch overhead of AllReduceNorm.__call__ ({date})",
        "",
        f"CPU: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
        f"torch {torch.__version__}; TP 1, T=8, H=4096, bf16; the backend a stub that returns at once; "
        "best of 7 runs of 100,000 calls.",
        "",
        "| backend | quant | op call (us) | direct stub call (us) | overhead (us) | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    with registered(*SPECS):
        for backend in ("dispatch_stub", "dispatch_stub_fast"):
            for quant in (None, "fp8_static"):
                a, b = measure(quant, backend)
                verdict = "met" if a - b < 2 else "MISSED"
                row = f"| {backend} | {quant or 'none'} | {a:.2f} | {b:.2f} | {a - b:.2f}"
                lines.append(f"{row} | {verdict} (< 2 us) |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(__file__).parent / "results" / f"dispatch-{date}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
