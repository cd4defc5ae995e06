"""The conformance cases on the flashinfer backend with two ranks sharing one GPU (gloo between them).

FlashInfer's TRT-LLM IPC workspace works with two processes on one GPU (seen on the H200,
2026-12-02), so a one-GPU machine can check every declared dtype and format against the reference
for real: argument marshaling, patterns, layouts, the numerics. The timing of such a run means
nothing. Run on the GPU machine after `source benchmarks/gpu_setup.sh`; it sets
ARNORM_FLASHINFER_SHARED_GPU=1 for its ranks and writes a table to $OUT (or benchmarks/results/).

    python3 benchmarks/check_flashinfer_conformance.py
"""

from __future__ import annotations

import datetime
import os
import pathlib
import time

os.environ["ARNORM_FLASHINFER_SHARED_GPU"] = "1"


def main() -> int:
    import pytest
    import torch

    from arnorm.testing import ConformanceSuite

    class Suite(ConformanceSuite):
        backend = "flashinfer"
        world_sizes = (2,)
        timeout = 900.0

    start = time.perf_counter()
    try:
        # Every case on two ranks, rank 0's rows; it fails when the ranks ended a case differently.
        rows, diverged = Suite.results(2), ""
    except (pytest.fail.Exception, pytest.skip.Exception) as exc:
        rows, diverged = [], str(exc)
    try:
        Suite().test_bad_inputs_raise_everywhere_and_leave_op_usable()
        bad = "raised InvalidInputError on both ranks, and the next good call matched"
    except (pytest.fail.Exception, pytest.skip.Exception) as exc:
        bad = f"FAILED: {exc}"
    took = time.perf_counter() - start
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU: nothing ran)"
    lines = [
        f"# flashinfer conformance, 2 ranks on one {gpu} ({datetime.date.today()})",
        "",
        "Every declared case of `arnorm.testing.ConformanceSuite` on `flashinfer` through",
        "`AllReduceNorm`, two processes on one GPU over gloo (`ARNORM_FLASHINFER_SHARED_GPU=1`),",
        "inputs whose fp32 sum is exact; rank 0's results (the ranks ended every case alike).",
        "Columns: residual bitwise equal to the contract; normed max ulps from the reference; fraction of",
        "quant codes (or scales) differing from `arnorm.quant` applied to the backend's own normed output;",
        "largest code distance. Command: `python3 benchmarks/check_flashinfer_conformance.py`.",
        "",
        "| case | outcome | residual | normed ulps | codes differing | max code diff | scales | note |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    worst = {"ulps": 0, "mismatch": 0.0, "residual": True, "errors": 0, "ran": 0}
    for r in rows:
        ulps = r.normed.max_ulps if r.normed else 0
        mismatch = r.codes.fraction if r.codes else 0.0
        if r.outcome == "ran":
            worst["ran"] += 1
            worst["ulps"] = max(worst["ulps"], ulps)
            worst["mismatch"] = max(worst["mismatch"], mismatch)
            worst["residual"] = worst["residual"] and r.residual is None
        worst["errors"] += r.outcome == "error"
        note = r.error or "; ".join(r.reasons)
        lines.append(
            f"| {r.case.id} | {r.outcome} | {'bitwise' if r.residual is None else 'DIFFERS'} | {ulps} | "
            f"{100 * mismatch:.4f}% | {r.codes.max_steps if r.codes else 0} | {r.scales or 'equal'} | "
            f"{note[:120]} |"
        )
    lines += [
        "",
        f"Ran {worst['ran']} cases in {took:.0f} s: residual bitwise everywhere: {worst['residual']}; "
        f"worst normed {worst['ulps']} ulp; worst quant mismatch {100 * worst['mismatch']:.4f}%; "
        f"errors: {worst['errors']}.",
        f"Bad inputs on both ranks: {bad}.",
    ]
    if diverged:
        lines += ["", f"The run stopped: {diverged}"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(os.environ.get("OUT") or pathlib.Path(__file__).parent / "results")
    (out / f"flashinfer-conformance-shared-gpu-{datetime.date.today()}.md").write_text(text)
    ok = rows and not diverged and worst["errors"] == 0 and worst["residual"] and not bad.startswith("FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
