#!/usr/bin/env bash
# One GPU round for the triton kernel (issue 14), on the H200 device machine, from the repo root:
#
#     bash lab/gpu_kernel_round.sh
#
# 1. sources benchmarks/gpu_setup.sh (wheels, FlashInfer bundle);
# 2. warms FlashInfer's JIT norm kernels in the background (bounded; absent FlashInfer is fine);
# 3. runs the triton tests on the GPU (tests/arnorm_triton, gpu-marked and the rest that run on the
#    GPU when one is present; not multigpu/slow), sharded over processes so Triton compiles in parallel;
# 4. measures the launch table (benchmarks/tune_launch_table.py --write-table: every warp candidate per
#    (H, format, outputs, T bucket)) and installs it in this tree for step 5;
# 5. benchmarks the public op against FlashInfer (benchmarks/bench_public_op.py).
# Everything lands in $OUT (at most 8 files): summary.txt, gpu-tests.log, run.log,
# launch-table-<date>.md, _launch_measured.py (commit it as arnorm_triton/_launch_measured.py),
# public-op-<date>-<gpu>.md/.json. Never aborts on a failing step; about 8 minutes at most.
# SKIP_TABLE=1 keeps the committed launch table; BENCH_ARGS adds arguments to step 5.
# CPU dry run of every step (what tests/arnorm_triton/test_bench_scripts.py does): SMOKE=1 runs the
# benchmarks with --smoke, and GPU_SETUP names a setup script to source instead of gpu_setup.sh.
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

log "setup"
# shellcheck disable=SC1091
source "${GPU_SETUP:-benchmarks/gpu_setup.sh}"
set +e
SMOKE_ARGS=()
[ "${SMOKE:-0}" = 1 ] && SMOKE_ARGS=(--smoke)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 \
  | tee -a "$OUT/summary.txt"

# 2. FlashInfer warm-up (JIT-compiles its CUDA norm kernels into its cache; bounded).
(
  timeout 300 python3 - <<'EOF'
import time
t0 = time.time()
import torch
import flashinfer, flashinfer.norm as fi
x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
r, w = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
fi.fused_add_rmsnorm(x, r, w, 1e-6)
q = torch.empty(4, 4096, device="cuda", dtype=torch.float8_e4m3fn)
fi.fused_add_rmsnorm_quant(q, x, r, w, torch.ones(1, device="cuda"), 1e-6)
torch.cuda.synchronize()
print(f"flashinfer {flashinfer.__version__}: norm kernels ready in {time.time() - t0:.0f} s")
EOF
  echo "fi-warmup exit $?"
) > /tmp/fi-warmup.log 2>&1 &
FI_PID=$!

# 3. GPU tests, sharded (Triton compiles each kernel variant on the CPU: parallel shards cut the wait).
log "gpu tests"
SEL=(-m "not multigpu and not slow")
python3 -m pytest --collect-only -q -p no:cacheprovider "${SEL[@]}" tests/arnorm_triton 2>/dev/null \
  | grep '::' > /tmp/test-ids.txt
NIDS=$(wc -l < /tmp/test-ids.txt)
SHARDS=${SHARDS:-6}
CHUNK=$(( (NIDS + SHARDS - 1) / SHARDS ))
for i in $(seq 0 $((SHARDS - 1))); do
  # Contiguous chunks: a kernel variant's parametrized tests stay together, so each is compiled once.
  awk -v c="$CHUNK" -v i="$i" 'NR > c * i && NR <= c * (i + 1)' /tmp/test-ids.txt > "/tmp/shard-$i.txt"
  (
    mapfile -t ids < "/tmp/shard-$i.txt"
    if [ "${#ids[@]}" -gt 0 ]; then
      timeout 180 python3 -m pytest -q -p no:cacheprovider --maxfail=20 "${ids[@]}" > "/tmp/shard-$i.log" 2>&1
      echo "shard $i exit $?" >> "/tmp/shard-$i.log"
    fi
  ) &
done
wait $(jobs -p | grep -v "^$FI_PID$") 2>/dev/null
for i in $(seq 0 $((SHARDS - 1))); do
  echo "=== shard $i ($(wc -l < "/tmp/shard-$i.txt") tests)" >> "$OUT/gpu-tests.log"
  cat "/tmp/shard-$i.log" >> "$OUT/gpu-tests.log" 2>/dev/null
done
PASSED=$(grep -hoE '[0-9]+ passed' /tmp/shard-*.log | awk '{s += $1} END {print s + 0}')
FAILED=$(grep -hoE '[0-9]+ failed' /tmp/shard-*.log | awk '{s += $1} END {print s + 0}')
ERRORS=$(grep -hoE '[0-9]+ errors?' /tmp/shard-*.log | awk '{s += $1} END {print s + 0}')
SKIPPED=$(grep -hoE '[0-9]+ skipped' /tmp/shard-*.log | awk '{s += $1} END {print s + 0}')
log "gpu tests: $NIDS collected, $PASSED passed, $FAILED failed, $ERRORS errors, $SKIPPED skipped"
grep -h '^FAILED\|^ERROR' /tmp/shard-*.log | head -20 | tee -a "$OUT/summary.txt"
grep -h 'exit' /tmp/shard-*.log | tr '\n' ' ' | tee -a "$OUT/summary.txt"; echo | tee -a "$OUT/summary.txt"

# 4. Launch table (installs arnorm_triton/_launch_measured.py in this copy of the tree for step 5);
#    SKIP_TABLE=1 keeps the committed table (a round about host cost only).
if [ "${SKIP_TABLE:-0}" = 1 ]; then
  log "launch table: skipped (SKIP_TABLE=1), the committed one is used"
else
  log "launch table"
  timeout 110 python3 benchmarks/tune_launch_table.py "${SMOKE_ARGS[@]}" --write-table --deadline 80 --out "$OUT" >> "$OUT/run.log" 2>&1
  log "launch table exit $?"
  sed -n '/^MEASURED/,/^}/p' "$OUT/_launch_measured.py" 2>/dev/null | tee -a "$OUT/summary.txt"
fi

# 5. The public op against FlashInfer.
wait "$FI_PID" 2>/dev/null
cat /tmp/fi-warmup.log >> "$OUT/run.log"
FI_ARGS=()
if ! grep -q "norm kernels ready" /tmp/fi-warmup.log; then
  FI_ARGS=(--no-flashinfer)
  log "flashinfer: not used ($(tail -n 2 /tmp/fi-warmup.log | tr '\n' ' '))"
else
  log "$(grep 'norm kernels ready' /tmp/fi-warmup.log)"
fi
log "public op bench"
# BENCH_ARGS: extra arguments, e.g. BENCH_ARGS="--eager-rounds 25".
# shellcheck disable=SC2086
timeout 200 python3 benchmarks/bench_public_op.py "${SMOKE_ARGS[@]}" --deadline 160 --out "$OUT" "${FI_ARGS[@]}" ${BENCH_ARGS:-} >> "$OUT/run.log" 2>&1
log "public op bench exit $?"

# Summary: the verdict rows of the public-op table.
MD=$(ls "$OUT"/public-op-*.md 2>/dev/null | head -1)
if [ -n "$MD" ]; then
  grep -E '^Copy bandwidth|^Error|^Skipped|^Targets' "$MD" | tee -a "$OUT/summary.txt"
  echo "eager (T = 1):" | tee -a "$OUT/summary.txt"
  awk '/^## Eager/{f=1} /^## CUDA/{f=0} f && /^\| [0-9]/' "$MD" | tee -a "$OUT/summary.txt"
  echo "graph verdicts (arnorm rows with a target):" | tee -a "$OUT/summary.txt"
  awk '/^## CUDA/{f=1} f && /^\| [0-9]/ && /(met|MISSED|below)/' "$MD" | cut -c1-160 | tee -a "$OUT/summary.txt"
fi
log "done"
