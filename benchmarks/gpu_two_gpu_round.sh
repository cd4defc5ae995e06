#!/usr/bin/env bash
# One round on a machine with two or more GPUs (the `nvidia-h200-x2` kind), from the repo root:
#
#     bash benchmarks/gpu_two_gpu_round.sh
#
# 1. sources benchmarks/gpu_setup.sh;
# 2. the multi-GPU tests: tests/arnorm_triton/test_triton_gpu.py -m multigpu (triton over NCCL,
#    all-reduce and exact modes, one rank per GPU) and triton_symm's leak test, while Triton
#    precompiles triton_symm's kernel configurations;
# 3. `arnorm bench --tp 2 --device cuda --backends triton_symm,triton` (CUDA-graph replay) at
#    H 8192 none / fp8_static / nvfp4 and H 4096 none, then H 8192 none with push off, one-shot off,
#    and one-shot up to 1,024 tokens (the crossovers benchmarks/results/README.md asks for).
# FlashInfer is disabled (ARNORM_DISABLE=flashinfer): on a fresh machine the bench's auto column
# would JIT-build its all-reduce module first, for minutes; time it in a round of its own.
# Everything lands in $OUT: summary.txt, tests.log, bench.txt, bench-<H>-<quant>.json. About 8 minutes.
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }
# shellcheck disable=SC1091
source "${GPU_SETUP:-benchmarks/gpu_setup.sh}"
set +e
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 PYTHONUNBUFFERED=1 ARNORM_DISABLE=flashinfer
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$OUT/summary.txt"
nvidia-smi topo -m >> "$OUT/summary.txt" 2>&1
(
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rA -m multigpu tests/arnorm_triton/test_triton_gpu.py \
    > "$OUT/tests.log" 2>&1
  echo "multigpu exit $?" >> "$OUT/tests.log"
) &
(timeout 120 python3 lab/check_triton_symm.py precompile > /tmp/precompile.log 2>&1) &
wait
timeout 90 python3 -m pytest -q -p no:cacheprovider -rA -k close_frees tests/arnorm_triton/test_symm_gpu.py \
  >> "$OUT/tests.log" 2>&1
echo "close_frees exit $?" >> "$OUT/tests.log"
log "tests: $(grep -hoE '[0-9]+ (passed|failed|skipped)' "$OUT/tests.log" | tr '\n' ' ')"
B=(arnorm bench --tp 2 --device cuda --backends triton_symm,triton --tokens 1,16,128,1024,8192)
for spec in "8192 none" "8192 fp8_static" "4096 none" "8192 nvfp4"; do
  # shellcheck disable=SC2086
  set -- $spec
  timeout 100 "${B[@]}" --hidden "$1" --quant "$2" --json "$OUT/bench-$1-$2.json" > /tmp/b.log 2>&1
  echo "exit $?" >> /tmp/b.log
  { echo "== H $1 $2 (defaults)"; sed 's/.*\r//' /tmp/b.log; } >> "$OUT/bench.txt"
  log "bench $1 $2"
done
for knob in ARNORM_TRITON_SYMM_PUSH_MAX_TOKENS=0 ARNORM_TRITON_SYMM_ONESHOT_MAX_TOKENS=0 \
  ARNORM_TRITON_SYMM_ONESHOT_MAX_TOKENS=1024; do
  [ $(( $(date +%s) - T0 )) -gt 480 ] && break
  env "$knob" timeout 80 "${B[@]}" --hidden 8192 --quant none > /tmp/b.log 2>&1
  { echo "== H 8192 none, $knob"; sed 's/.*\r//' /tmp/b.log; } >> "$OUT/bench.txt"
  log "bench $knob"
done
log done
