"""arnorm's ROCm AITER backend: AITER's fused all-reduce + residual add + RMSNorm (+ per-token FP8).

It drives ``aiter.dist.device_communicators.custom_all_reduce.CustomAllreduce.fused_ar_rms`` on
AMD Instinct GPUs (gfx942: MI300X / MI325X; gfx950: MI350X / MI355X) at TP 2, 4 and 8 on one node.
Install with ``pip install 'arnorm[aiter]'`` (or a ROCm image that ships aiter >= 0.1.19.post1).

Nothing here imports ``aiter`` before an op is built on a ROCm machine: importing it has side
effects (JIT builds, subprocesses, ``SystemExit`` on failure). ``docs/aiter.md`` states what the
backend serves, how its numerics differ from arnorm's contract, and that the project has not yet
run it on AMD hardware.
"""
