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
    import torch

    from arnorm.testing import run_ranks
    from arnorm.testing._cases import bad_inputs_then_good, run_cases
    from arnorm.testing.conformance import ConformanceSuite

    class Suite(ConformanceSuite):
        backend = "flashinfer"

    cases = Suite.cases()
    start = time.perf_counter()
    per_rank = run_ranks(2, run_cases, "flashinfer", cases, "cuda", timeout=900)
    bad = run_ranks(2, bad_inputs_then_good, "flashinfer", "cuda")
    took = time.perf_counter() - start
    lines = [
        f"# flashinfer conformance, 2 ranks on one {torch.cuda.get_device_name()} ({datetime.date.today()})",
        "",
        "Every declared case of `arnorm.testing.ConformanceSuite` on `flashinfer` through",
        "`AllReduceNorm`, two processes on one GPU over gloo (`ARNORM_FLASHINFER_SHARED_GPU=1`),",
        "inputs whose fp32 sum is exact.",
        "Columns: residual bitwise equal to the contract; normed max ulps from the reference; fraction of",
        "quant codes (or scales) differing from `arnorm.quant` applied to the backend's own normed output;",
        "largest code distance. Command: `python3 benchmarks/check_flashinfer_conformance.py`.",
        "",
        "| case | rank | residual | normed ulps | codes differing | max code diff | scales equal | note |",
        "|---|---:|---|---:|---:|---:|---|---|",
    ]
    worst = {"ulps": 0, "mismatch": 0.0, "residual": True, "errors": 0, "ran": 0}
    for rank, rows in enumerate(per_rank):
        for r in rows:
            note = r.error or ("; ".join(r.skipped) if r.skipped else "")
            if not r.skipped and not r.error:
                worst["ran"] += 1
                worst["ulps"] = max(worst["ulps"], r.normed_ulps)
                worst["mismatch"] = max(worst["mismatch"], r.quant_mismatch)
                worst["residual"] = worst["residual"] and r.residual_equal
            worst["errors"] += bool(r.error)
            lines.append(
                f"| {r.case.id} | {rank} | {'yes' if r.residual_equal else ('-' if note else 'NO')} | "
                f"{r.normed_ulps} | {100 * r.quant_mismatch:.4f}% | {r.quant_max_code_diff} | "
                f"{'yes' if r.quant_scales_equal else 'NO'} | {note[:120]} |"
            )
    lines += [
        "",
        f"Ran {worst['ran']} case-ranks in {took:.0f} s: residual bitwise everywhere: {worst['residual']}; "
        f"worst normed {worst['ulps']} ulp; worst quant mismatch {100 * worst['mismatch']:.4f}%; "
        f"errors: {worst['errors']}.",
        f"Bad inputs on both ranks: {bad[0][0]} -> next good call matches: {bad[0][1]}; "
        f"ranks agree: {bad[0] == bad[1]}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(os.environ.get("OUT") or pathlib.Path(__file__).parent / "results")
    (out / f"flashinfer-conformance-shared-gpu-{datetime.date.today()}.md").write_text(text)
    return 0 if worst["errors"] == 0 and worst["residual"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
