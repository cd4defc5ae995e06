"""Host cost of one eager ``triton`` call at T=1, piece by piece, on CPU.

What an engine without CUDA graphs pays every layer is host time: the core's checks, the
backend's glue, the output allocation, and the launch. This times the real
:class:`arnorm_triton._backend.TritonBackend` call path with the compiled kernel's launcher
(``CompiledKernel.run``, a C function on a GPU) replaced by a no-op, so every Python line the
GPU path runs is timed and the kernel is not. The direct-launch path is the one taken: the stub
is bound exactly where :meth:`FusedLauncher.bind` binds the real launcher after validating it.

Columns (microseconds per call, the timing loop's own cost taken out): ``op call`` and ``op
out=``, the whole ``AllReduceNorm.__call__`` allocating and with caller-provided outputs (the op
selects ``triton`` on CPU because this script sets ``TRITON_INTERPRET=1`` before the import);
``fast path``, the backend's ``fast_path()`` function the op calls (pointers given, allocating);
``core`` and ``core out=``, each op call minus its fast path (the core's checks); ``backend
call``, the backend's ``__call__`` (the route at TP > 1 and for strided rows); its pieces ``alloc``
(the outputs), ``launch`` (the launcher with preallocated outputs; ``launch glue`` is that minus
the stub's own call with the same arguments), ``output`` (the ``Output`` construction) and
``glue`` (the backend call minus those three); and ``empty (1,H)``, one ``torch.empty``: the floor
of any call that returns a fresh tensor. Best of 7 runs of 50,000 calls each; T=1, H=4096, bf16.

    python lab/bench_host_path.py [--number N] [--repeat R]

CPU-side figures are a guide to relative cost; the GPU's figures (benchmarks/bench_public_op.py)
add the C launcher and the CUDA caching allocator.
"""

from __future__ import annotations

import argparse
import os
import platform
import timeit

os.environ.setdefault("TRITON_INTERPRET", "1")  # before arnorm_triton is imported: the op selects triton

import torch

import arnorm
from arnorm_triton._direct import Bound

H = 4096
#: (label, quant, scale_layout, normed_output)
CASES = [
    ("none+normed", None, None, True),
    ("fp8_static", "fp8_static", None, False),
    ("fp8_static+normed", "fp8_static", None, True),
    ("nvfp4 swizzled", "nvfp4", "swizzled_128x4", False),
    ("mxfp8 swizzled", "mxfp8", "swizzled_128x4", False),
]


def _noop_run(*args: object) -> None:
    """Stands in for ``CompiledKernel.run`` (the compiled kernel's C launcher)."""


def _recording_run(*args: object) -> None:
    """The stub, remembering its arguments once (to time the stub's own share of a launch)."""
    _LAST_ARGS[:] = args


_LAST_ARGS: list[object] = []


def stub_launcher(launcher, run=_noop_run) -> None:
    """Bind ``run`` as the launcher of every configuration the op uses, as a validated bind would."""
    launcher.unbind()
    for cfg in launcher.configs(64):
        launcher._bound[cfg] = Bound(run, None, (None, None, None, None))
    # torch's _cuda_getCurrentRawStream is a C function of the device index; abs(0) == 0 is one too.
    launcher._get_stream = abs
    launcher._device_index = 0


def _best(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure(quant, layout, normed, number: int, repeat: int) -> dict[str, float]:
    op = arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=H,
        dtype=torch.bfloat16,
        norm=arnorm.RMSNorm(),
        quant=quant,
        scale_layout=layout,
        normed_output=normed,
        max_tokens=64,
        device="cpu",
        backend="triton",
    )
    backend = op._dispatch.table[1]
    assert type(backend).__name__ == "TritonBackend", type(backend)
    launcher = backend.launcher
    stub_launcher(launcher)
    g = torch.Generator().manual_seed(0)
    x = torch.randn((1, H), generator=g).to(torch.bfloat16)
    r = torch.randn((1, H), generator=g).to(torch.bfloat16)
    w = torch.randn((H,), generator=g).to(torch.bfloat16)
    s = torch.ones(1) if quant in ("fp8_static", "nvfp4") else None
    y, q, sf = backend._alloc(1)
    backend(x, r, w, s)  # per-T cache entries filled, as after the first step
    op(x, r, w, s)
    assert launcher._by_rows[1][0] is not None, "the direct (stubbed) launch must be taken"

    stub_launcher(launcher, _recording_run)
    launcher.launch(x, r, w, s, x, y, q, sf, 1, H, H, H)
    args = tuple(_LAST_ARGS)
    stub_launcher(launcher)
    backend(x, r, w, s)
    out = op.empty_output(1, s)
    fast = op._dispatch.fast_table[1]
    assert fast is not None, "triton at TP 1 offers a fast path"
    ptrs = (x.data_ptr(), r.data_ptr(), w.data_ptr(), 0 if s is None else s.data_ptr())
    rows = {
        "stub run": _best(lambda: _noop_run(*args), number, repeat),
        "op call": _best(lambda: op(x, r, w, s), number, repeat),
        "op out=": _best(lambda: op(x, r, w, s, out=out), number, repeat),
        "fast path": _best(lambda: fast(1, x, r, w, s, None, *ptrs), number, repeat),
        "fast out=": _best(lambda: fast(1, x, r, w, s, out, *ptrs), number, repeat),
        "backend call": _best(lambda: backend(x, r, w, s), number, repeat),
        "alloc": _best(lambda: backend._alloc(1), number, repeat),
        "launch": _best(lambda: launcher.launch(x, r, w, s, x, y, q, sf, 1, H, H, H), number, repeat),
        "output": _best(lambda: backend._output(y, x, q, sf, s), number, repeat),
        "empty (1,H)": _best(lambda: torch.empty((1, H), dtype=torch.bfloat16), number, repeat),
        "lambda": _best(lambda: None, number, repeat),
    }
    lam = rows.pop("lambda")  # the timing harness's own call, taken out of every row
    rows = {k: v - lam for k, v in rows.items()}
    rows["glue"] = rows["backend call"] - rows["alloc"] - rows["launch"] - rows["output"]
    rows["core"] = rows["op call"] - rows["fast path"]
    rows["core out="] = rows["op out="] - rows["fast out="]
    rows["launch glue"] = rows["launch"] - rows["stub run"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    cols = ["op call", "op out=", "fast path", "core", "core out=", "backend call", "alloc", "launch",
            "launch glue", "output", "glue"]  # fmt: skip
    cols.append("empty (1,H)")
    print(
        f"# Eager host path at T=1, H={H}, bf16, stub launcher "
        f"(us/call; best of {args.repeat} x {args.number})\n"
        f"CPU: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
        f"torch {torch.__version__}\n"
    )
    print("| format | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for label, quant, layout, normed in CASES:
        rows = measure(quant, layout, normed, args.number, args.repeat)
        print(f"| {label} | " + " | ".join(f"{rows[c]:.2f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
