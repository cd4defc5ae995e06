#!/usr/bin/env bash
# One GPU round for triton_symm (issue 13), on the one-H200 device machine, from the repo root:
#
#     bash lab/gpu_symm_round.sh
#
# 1. sources benchmarks/gpu_setup.sh; makes sure the installed arnorm dist-info registers the
#    triton_symm entry point (a wheel built before this branch lacks it: the line is added);
# 2. smoke: 2 ranks sharing the GPU, one call of each kind (stops early with the reason if even
#    that fails, so the rest of the round is not spent on timeouts);
# 3. precompiles every kernel configuration the tests build, in parallel processes (Triton's cache);
# 4. the GPU tests: tests/arnorm_triton/test_symm_gpu.py (2 and 4 processes sharing the GPU: every
#    format one-/two-shot, 1,000 CUDA-graph replays, late ranks, the bounded wait, close(), the
#    conformance suite at TP 2 and 4), in 3 shards side by side, and the plugin tests;
# 5. the flag-poll latency (what ARNORM_TRITON_SYMM_SPIN_LIMIT means in seconds);
# 6. timing: the kernel at TP 1 (world 1; world 2 with a peer that is always ready, and two ranks
#    pushing to each other on two streams: the
#    protocol's fixed cost) against triton, the eager host time of triton_symm's direct launch
#    against kernel[grid], and TP 2 on the shared GPU (correctness and plumbing only).
# Everything lands in $OUT: summary.txt, symm-tests.log, run.log, triton-symm-<date>.md/.json.
# Never aborts on a failing step; at most BUDGET (560) seconds plus setup: every step's timeout is
# capped by what is left of the round. TP1_DEADLINE (150) is the seconds the TP 1 table may take
# (its `push self W=4/8` columns compile two more kernels per shape).
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET="${BUDGET:-560}"  # seconds for the whole round
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }
# A step's timeout: its own cap, or what is left of the round (at least 20 s), whichever is less.
left() { local l=$(( BUDGET - ($(date +%s) - T0) )); [ "$l" -lt 20 ] && l=20; [ "$1" -lt "$l" ] && l=$1; echo "$l"; }

log "setup"
# shellcheck disable=SC1091
source "${GPU_SETUP:-benchmarks/gpu_setup.sh}"
set +e
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 REQUIRE_TRITON_SYMM=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 \
  | tee -a "$OUT/summary.txt"

# 1b. The entry point: plugin discovery reads the installed dist-info, not the tree.
python3 - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import importlib.metadata as md, pathlib
eps = [e for e in md.entry_points(group="arnorm.backends")]
if any(e.name == "triton_symm" for e in eps):
    print("entry point triton_symm: registered")
else:
    dist = md.distribution("arnorm")
    path = pathlib.Path(dist._path) / "entry_points.txt"  # the installed wheel's file
    text = path.read_text()
    line = "triton_symm = arnorm_triton.symm._plugin\n"
    if "[arnorm.backends]\n" in text:
        text = text.replace("[arnorm.backends]\n", "[arnorm.backends]\n" + line, 1)
    else:
        text += "\n[arnorm.backends]\n" + line
    path.write_text(text)
    print(f"entry point triton_symm: added to {path}")
PY
python3 -c "import arnorm; print({b.name: (b.status, b.priority) for b in arnorm.backends()})" 2>&1 \
  | tee -a "$OUT/summary.txt"

# 2. Smoke.
log "smoke"
timeout "$(left 150)" python3 lab/check_triton_symm.py smoke >> "$OUT/run.log" 2>&1
SMOKE=$?
log "smoke exit $SMOKE"
grep -E "bitwise|FAILED|passed|built" "$OUT/run.log" | head -12 | tee -a "$OUT/summary.txt"

# 3. Precompile (skipped if the smoke test failed: the tests would fail the same way).
if [ "$SMOKE" = 0 ]; then
  log "precompile"
  timeout "$(left 120)" python3 lab/check_triton_symm.py precompile >> "$OUT/run.log" 2>&1
  log "precompile exit $?"
  grep -E "kernel configurations compiled" "$OUT/run.log" | tail -1 | tee -a "$OUT/summary.txt"
fi

# 4. Tests: the GPU file in 3 shards (the conformance suite; the rest split in two), run side by side:
#    process start-up and op builds are CPU work; the GPU is time-sliced between the shards' ranks.
if [ "$SMOKE" = 0 ]; then
  log "gpu tests"
  F=tests/arnorm_triton/test_symm_gpu.py
  python3 -m pytest --collect-only -q -p no:cacheprovider "$F" 2>/dev/null | grep '::' > /tmp/symm-ids.txt
  grep 'Conformance' /tmp/symm-ids.txt > /tmp/symm-shard-0.txt
  # The leak test reads the device-wide memory in use, which the other shards' ranks would move:
  # it runs alone, after them (shard 3).
  grep -v 'Conformance\|close_frees' /tmp/symm-ids.txt | awk 'NR % 2 == 1' > /tmp/symm-shard-1.txt
  grep -v 'Conformance\|close_frees' /tmp/symm-ids.txt | awk 'NR % 2 == 0' > /tmp/symm-shard-2.txt
  grep 'close_frees' /tmp/symm-ids.txt > /tmp/symm-shard-3.txt
  TT=$(left 300)
  for i in 0 1 2; do
    (
      mapfile -t ids < "/tmp/symm-shard-$i.txt"
      if [ "${#ids[@]}" -gt 0 ]; then
        timeout "$TT" python3 -m pytest -q -p no:cacheprovider -rA --durations=10 "${ids[@]}" \
          > "/tmp/symm-shard-$i.log" 2>&1
        echo "shard $i exit $?" >> "/tmp/symm-shard-$i.log"
      fi
    ) &
  done
  wait
  mapfile -t ids < /tmp/symm-shard-3.txt
  if [ "${#ids[@]}" -gt 0 ]; then
    timeout "$(left 90)" python3 -m pytest -q -p no:cacheprovider -rA "${ids[@]}" > /tmp/symm-shard-3.log 2>&1
    echo "shard 3 exit $?" >> /tmp/symm-shard-3.log
  fi
  for i in 0 1 2 3; do
    echo "=== shard $i ($(wc -l < "/tmp/symm-shard-$i.txt") tests)" >> "$OUT/symm-tests.log"
    cat "/tmp/symm-shard-$i.log" >> "$OUT/symm-tests.log" 2>/dev/null
  done
  PASSED=$(grep -hoE '[0-9]+ passed' /tmp/symm-shard-*.log | awk '{s += $1} END {print s + 0}')
  FAILED=$(grep -hoE '[0-9]+ failed' /tmp/symm-shard-*.log | awk '{s += $1} END {print s + 0}')
  ERRORS=$(grep -hoE '[0-9]+ errors?' /tmp/symm-shard-*.log | awk '{s += $1} END {print s + 0}')
  SKIPPED=$(grep -hoE '[0-9]+ skipped' /tmp/symm-shard-*.log | awk '{s += $1} END {print s + 0}')
  log "gpu tests: $(wc -l < /tmp/symm-ids.txt) collected, $PASSED passed, $FAILED failed, $ERRORS errors, $SKIPPED skipped"
  grep -h '^FAILED\|^ERROR' /tmp/symm-shard-*.log | cut -c1-220 | head -20 | tee -a "$OUT/summary.txt"
  grep -h 'exit' /tmp/symm-shard-*.log | tr '\n' ' ' | tee -a "$OUT/summary.txt"; echo | tee -a "$OUT/summary.txt"
else
  log "gpu tests skipped: the smoke test failed (see run.log)"
fi
timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider tests/arnorm_triton/test_symm_plugin.py \
  >> "$OUT/symm-tests.log" 2>&1
log "plugin tests exit $?"

# 5. Poll latency.
log "calibrate"
timeout "$(left 40)" python3 lab/check_triton_symm.py calibrate >> "$OUT/run.log" 2>&1
log "calibrate exit $?"
grep -E "gives up after" "$OUT/run.log" | tail -1 | tee -a "$OUT/summary.txt"

# 6. Timing.
log "tp1 timing"
timeout "$(left $(( ${TP1_DEADLINE:-150} + 50 )))" python3 lab/check_triton_symm.py tp1 --deadline "${TP1_DEADLINE:-150}" >> "$OUT/run.log" 2>&1
log "tp1 exit $?"
if [ "$SMOKE" = 0 ]; then
  log "tp2 timing (shared GPU: correctness only)"
  timeout "$(left 120)" python3 lab/check_triton_symm.py tp2 --deadline 40 >> "$OUT/run.log" 2>&1
  log "tp2 exit $?"
fi
MD=$(ls "$OUT"/triton-symm-*.md 2>/dev/null | head -1)
if [ -n "$MD" ]; then
  echo "--- TP 1 (one-shot / triton) ---" | tee -a "$OUT/summary.txt"
  awk '/^## TP 1/{f=1} /^## TP 2/{f=0} f && /^\| [0-9a-z]/' "$MD" | tee -a "$OUT/summary.txt"
fi
log "done (results in $OUT; commit triton-symm-*.md/json under benchmarks/results/)"
