#!/usr/bin/env bash
# Issue 43 in one device call (one GPU, from the repo root, .gpu/ carried in):
#
#     bash lab/gpu_l2_round.sh          # about 7 minutes; BUDGET=<seconds> bounds it (default 500)
#
# TP 1, T 1024, H 8192, no quantization, normed output: arnorm 20.1 us against FlashInfer's 17.0
# on an H100 (2026-12-06). The suspected cause is the L2, not the kernel's shape: the bench replays
# one set of buffers, and arnorm's call touches 48 MiB there (x, the residual, the normed output)
# where FlashInfer's in-place call touches 32 MiB, against a 50 MiB L2 (lab/l2_variants.py).
#
# 1. the public op's bench (focused: H 8192/4096, T 128-8192, none and fp8_static, FlashInfer
#    beside it) on this tree ("before") and on this tree with the candidate kernel ("after":
#    lab/l2_variants.py's `yfirst`, the normed output stored evict_first), in that order;
# 2. the triton GPU tests on the candidate tree;
# 3. lab_kernel_variants.py: every variant of lab/l2_variants.py interleaved, with FlashInfer, on
#    the `l2` cells (the L2 cliff: T H from 1M to 64M), then base and yfirst at 4-32 warps (`l2w`).
# $OUT: summary.txt (the T 1024/2048 rows of both benches, step times), run.log, results.tgz (the
# benches' .md/.json). Each step is skipped when too little of BUDGET is left for it.
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
BUDGET="${BUDGET:-500}"
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/summary.txt"; }

log "setup"
# shellcheck disable=SC1091
source "${GPU_SETUP:-benchmarks/gpu_setup.sh}"
set +e
set -o pipefail
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  2>&1 | tee -a "$OUT/summary.txt"
RES=/tmp/l2res VAR=/tmp/l2var CAND=/tmp/l2cand
mkdir -p "$RES" "$CAND"
VARIANTS=$(python3 lab/l2_variants.py arnorm_triton/_kernels.py "$VAR")
cp -r arnorm_triton "$CAND/" && cp "$VAR/yfirst.py" "$CAND/arnorm_triton/_kernels.py"
BENCH=(--no-eager --hidden 8192,4096 --tokens 128,1024,2048,8192 --formats none,fp8_static --replays 15)

for side in before after; do
  budget=$(( $(left) / 2 - 20 ))
  [ "$side" = after ] && budget=$(( $(left) > 150 ? 150 : $(left) - 10 ))
  if [ "$budget" -lt 60 ]; then log "bench $side: skipped (budget)"; continue; fi
  log "bench $side"
  path="$PYTHONPATH"
  [ "$side" = after ] && path="$CAND:$PYTHONPATH"
  PYTHONPATH="$path" timeout "$budget" python3 benchmarks/bench_public_op.py "${BENCH[@]}" \
    --deadline $((budget - 10)) --out "$RES/$side" >>"$OUT/run.log" 2>&1
  log "bench $side: rc $?"
  grep -E "^\| (1024|2048) \| (8192|4096) \| none \| yes \| (arnorm \(triton\)|fi_)" "$RES/$side"/public-op-*.md \
    | cut -d'|' -f2-11 | tee -a "$OUT/summary.txt"
done
tar czf "$OUT/results.tgz" -C "$RES" .

if [ "$(left)" -gt 150 ]; then
  log "triton GPU tests (candidate tree)"
  PYTHONPATH="$CAND:$PYTHONPATH" timeout $(( $(left) - 100 )) python3 -m pytest -q tests/arnorm_triton/test_triton_gpu.py \
    tests/arnorm_triton/test_out_gpu.py 2>&1 | tail -5 | tee -a "$OUT/summary.txt"
fi
if [ "$(left)" -gt 90 ]; then
  log "lab l2 variants"
  # shellcheck disable=SC2086
  timeout $(( $(left) - 40 )) python3 lab/lab_kernel_variants.py $VARIANTS --cells l2 --rounds 4 --flashinfer \
    2>&1 | tee -a "$OUT/run.log" | grep "^|" | tee -a "$OUT/summary.txt"
fi
if [ "$(left)" -gt 45 ]; then
  log "lab l2w warps"
  timeout $(( $(left) - 5 )) python3 lab/lab_kernel_variants.py "base=$VAR/base.py" "yfirst=$VAR/yfirst.py" \
    --cells l2w --rounds 3 --warps 4,8,16,32 --flashinfer 2>&1 | tee -a "$OUT/run.log" | grep "^|" | tee -a "$OUT/summary.txt"
fi
log "done"
