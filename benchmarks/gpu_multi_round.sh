#!/usr/bin/env bash
# One round on a machine with 2, 4 or 8 GPUs (the `nvidia-h200-x2/x4/x8` kinds), from the repo root,
# in one device call (at most 10 minutes):
#
#     bash benchmarks/gpu_multi_round.sh                 # BUDGET=570 seconds by default
#     DRY_RUN=1 bash benchmarks/gpu_multi_round.sh       # or --dry-run: the same logic on CPU
#
# 1. sources benchmarks/gpu_setup.sh; N = `nvidia-smi -L | wc -l`;
# 2. starts FlashInfer's all-reduce JIT build in the background at once (about 6 minutes on a fresh
#    machine; nothing times FlashInfer before it has ended);
# 3. while it builds: every test marked `multigpu` (outside tests/arnorm_flashinfer) and triton_symm's
#    leak test, `arnorm demo --model llama` and `--model gemma3` at TP 2 on two GPUs (NCCL), and
#    benchmarks/multi_gpu_faults.py (a rank killed mid-call, a stalled rank, a late rank: NCCL +
#    symmetric memory); then `arnorm bench --backends triton_symm,triton` (FlashInfer disabled) per
#    TP in 2, 4, 8 (up to N), H 8192 / 4096, none / fp8_static / nvfp4, T 1-8192, bf16, CUDA-graph
#    replay, slowest rank, the NCCL + torch baseline beside them;
# 4. once the build has ended: the same sweep with `--backends flashinfer,auto` (FlashInfer's
#    nvfp4 is rejected on SM 9.0: its reason is printed under the table) and the multi-GPU FlashInfer
#    tests. Jobs on disjoint GPU groups run side by side; the order is by worth (H 8192 none first);
#    a job whose time does not fit is listed as not run, and `TPS=4,8 bash ...` runs the rest;
# 5. at TP 8, H 8192: triton_symm with push off at T 1 and 16 against push on (the world-8 push
#    kernel spills 368 bytes per thread: if push is no slower than the flag one-shot, it is harmless).
#
# Everything lands in $OUT: summary.txt (one line per step: read it first), bench-summary.md (every
# bench merged: per TP, H, quant and T each backend's median, what auto ran, the fastest, auto
# against it, and issue 38's targets), hardware.txt, one .txt (and .json) per step.
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
DRY_RUN="${DRY_RUN:-0}"
BUDGET="${BUDGET:-570}"
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET))
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/summary.txt"; }
if [ "$DRY_RUN" = 1 ]; then
  PY="${PYTHON:-python3}"
  export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
  export PYTHONPATH="$PWD:$PWD/backends/arnorm-example${PYTHONPATH:+:$PYTHONPATH}"
  N=2
  TPS=2
  log "DRY RUN on CPU: gloo, tiny shapes, Triton's interpreter; no number here is a measurement"
else
  # shellcheck disable=SC1091
  source "${GPU_SETUP:-benchmarks/gpu_setup.sh}"
  set +e
  PY=python3
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 PYTHONUNBUFFERED=1
  N=$(nvidia-smi -L | wc -l)
fi
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit $(git rev-parse --short HEAD 2>/dev/null); GPUs: $N"
  if [ "$DRY_RUN" = 1 ]; then echo "CPU: $(nproc) cores (dry run)"; else
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>&1
    nvidia-smi topo -m 2>&1
  fi
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
} > "$OUT/hardware.txt"
log "$(head -1 "$OUT/hardware.txt"); $(sed -n 2p "$OUT/hardware.txt")"
case "$N" in 2 | 4 | 8) ;; *) log "GPUs: $N (this round expects 2, 4 or 8; TP sizes above $N are left out)" ;; esac
rm -f "$OUT/fi-build.log.done"
(
  timeout $((DEADLINE - $(date +%s) - 30)) $PY benchmarks/multi_gpu_round.py build-flashinfer \
    > "$OUT/fi-build.log" 2>&1
  echo "exit $?" >> "$OUT/fi-build.log"
  touch "$OUT/fi-build.log.done"
) &
DRY=()
[ "$DRY_RUN" = 1 ] && DRY=(--dry-run)
$PY benchmarks/multi_gpu_round.py run --out "$OUT" --gpus "$N" --tps "${TPS:-2,4,8}" \
  --deadline $((DEADLINE - 10)) --steps "${STEPS:-functional,timed}" "${DRY[@]}" > "$OUT/round.log" 2>&1
log "round exit $?; read bench-summary.md (its 'Targets' lines answer issue 38's targets, the spill included)"
wait
