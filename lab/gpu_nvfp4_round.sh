#!/usr/bin/env bash
# The nvfp4 lab round (issue 14, item 3) on the H200, from the repo root (under 200 s, the limit
# lab/gpu_rounds.sh gives it):
#
#     bash lab/gpu_nvfp4_round.sh
#
# 1. sources benchmarks/gpu_setup.sh;
# 2. lab/bench_nvfp4_lab.py: compiles every kernel in parallel, checks every lab variant
#    bit for bit against the production kernel (zeros, huge values, NaN, inf, H = 2000 and 80,
#    scales realistic / 1e36 / inf / 0), measures copy bandwidth and times production and every
#    variant (CUDA graphs of 20 calls, median) at T in {8192, 16384} x H in {4096, 8192} x normed;
# 3. if ncu is on PATH: one profile each of the production kernel and the best variant at
#    T = 8192, H = 4096 (no normed output), --clock-control none, a small metric set; bounded.
# SMOKE=1 GPU_SETUP=<script>: CPU dry run. Everything lands in $OUT: summary.txt, run.log, nvfp4-lab.md/.json, ncu-*.txt. Never aborts early.
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

log "setup"
# shellcheck disable=SC1091
source "${GPU_SETUP:-benchmarks/gpu_setup.sh}"
set +e
SMOKE_ARGS=()
[ "${SMOKE:-0}" = 1 ] && SMOKE_ARGS=(--smoke)  # CPU dry run of the script (interpreter, tiny shapes)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"

log "lab: compile, exactness, timings"
timeout 140 python3 lab/bench_nvfp4_lab.py "${SMOKE_ARGS[@]}" --out "$OUT" --deadline 100 > "$OUT/run.log" 2>&1
log "lab exit $?"

if command -v ncu > /dev/null 2>&1 && [ -f "$OUT/nvfp4-lab.json" ]; then
  BEST=$(python3 lab/bench_nvfp4_lab.py --out "$OUT" --best 2>/dev/null | tail -n 1)
  PW=$(python3 -c "import json; r=[r for r in json.load(open('$OUT/nvfp4-lab.json'))['timings'] if r['kernel']=='production' and (r['T'],r['H'],r['normed'],r['swizzled'])==(8192,4096,False,True)]; print(r[0]['warps'] if r else 8)" 2>/dev/null)
  METRICS=gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_issued.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum,launch__registers_per_thread
  for K in "production:${PW:-8}" "$BEST"; do
    # lab/gpu_rounds.sh gives this round 200 s: profile only while 20 s of it remain.
    if [ $(( $(date +%s) - T0 )) -gt 165 ]; then log "ncu $K: skipped (time)"; continue; fi
    log "ncu $K"
    timeout 20 ncu --clock-control none -k regex:'fused_add_rmsnorm_quant_kernel|lab_kernel' --launch-skip 4 \
      --launch-count 1 --metrics "$METRICS" python3 lab/bench_nvfp4_lab.py --profile "$K" \
      > "$OUT/ncu-${K/:/-w}.txt" 2>&1
    log "ncu exit $?"
    grep -E 'gpu__time|throughput|inst_|warps_active|wavefronts|local_op|registers' "$OUT/ncu-${K/:/-w}.txt" \
      | sed 's/^ */  /' | tee -a "$OUT/summary.txt"
  done
else
  log "ncu: not on PATH (or no lab json): skipped"
fi

# Summary: exactness failures, the production-vs-best table and the per-kernel ranking.
MD="$OUT/nvfp4-lab.md"
if [ -f "$MD" ]; then
  grep -E '^Copy bandwidth' "$MD" | tee -a "$OUT/summary.txt"
  echo "exactness: $(grep -c ': ok' "$MD") ok, $(grep -cE ': (FAIL|ERROR)' "$MD") failed" | tee -a "$OUT/summary.txt"
  grep -E '^- .*: (FAIL|ERROR)' "$MD" | head -20 | tee -a "$OUT/summary.txt"
  sed -n '/^## Summary/,/^## Per kernel/p' "$MD" | grep '^|' | tee -a "$OUT/summary.txt"
  sed -n '/^## Per kernel/,$p' "$MD" | grep '^- ' | head -16 | tee -a "$OUT/summary.txt"
else
  log "no nvfp4-lab.md: see $OUT/run.log"; tail -n 30 "$OUT/run.log" | tee -a "$OUT/summary.txt"
fi
log "done"
