#!/usr/bin/env bash
# Every single-GPU test of the repository on one GPU machine, from the repository root:
#
#     bash benchmarks/gpu_tests.sh            # SHARDS=8 TIMEOUT=300 by default
#
# Sources benchmarks/gpu_setup.sh, collects the tests marked `gpu` anywhere (not `multigpu`: those
# need several GPUs, and benchmarks/gpu_multi_round.sh runs them) and every other test of the
# Triton backends (which compile for the GPU when one is present), and runs them in SHARDS parallel
# pytest processes (contiguous chunks, so a kernel variant's cases compile once). Tests that start
# several ranks on the one GPU (triton_symm's, with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1)
# run among them: they prove the code correct and graph-safe, never fast.
# ONLY / EXCLUDE: extended regular expressions over the test ids, to run part of the suite.
# Writes $OUT/gpu-tests.log and a one-line summary to $OUT/summary.txt.
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
SHARDS="${SHARDS:-8}"
# shellcheck disable=SC1091
source "${GPU_SETUP:-benchmarks/gpu_setup.sh}"
set +e
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
{
  python3 -m pytest -q -p no:cacheprovider --collect-only -m "gpu and not multigpu" tests 2>/dev/null
  python3 -m pytest -q -p no:cacheprovider --collect-only -m "not multigpu and not rocm and not slow" \
    tests/arnorm_triton 2>/dev/null
} | grep '::' | awk '!seen[$0]++' | grep -E "${ONLY:-.}" | { grep -v -E "${EXCLUDE:-^$}" || true; } \
  > /tmp/gpu-test-ids.txt
NIDS=$(wc -l < /tmp/gpu-test-ids.txt)
# The tests that start several ranks on the one GPU (SLOW, triton_symm's) take 5-15 s each: dealt
# out one per shard in turn, at each shard's end, so no shard holds them all (one that did ran out
# of TIMEOUT with 70 of them unrun, 2026-12-07). The others go in contiguous chunks.
SLOW="${SLOW:-tests/arnorm_triton/symm/}"
grep -F -- "$SLOW" /tmp/gpu-test-ids.txt > /tmp/gpu-test-slow.txt || true
grep -v -F -- "$SLOW" /tmp/gpu-test-ids.txt > /tmp/gpu-test-fast.txt || true
CHUNK=$(( ($(wc -l < /tmp/gpu-test-fast.txt) + SHARDS - 1) / SHARDS ))
for i in $(seq 0 $((SHARDS - 1))); do
  {
    awk -v c="$CHUNK" -v i="$i" 'NR > c * i && NR <= c * (i + 1)' /tmp/gpu-test-fast.txt
    awk -v n="$SHARDS" -v i="$i" '(NR - 1) % n == i' /tmp/gpu-test-slow.txt
  } > "/tmp/gpu-shard-$i.txt"
  (
    mapfile -t ids < "/tmp/gpu-shard-$i.txt"
    if [ "${#ids[@]}" -gt 0 ]; then
      timeout "${TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rf --maxfail=20 "${ids[@]}" \
        > "/tmp/gpu-shard-$i.log" 2>&1
      echo "shard $i exit $?" >> "/tmp/gpu-shard-$i.log"
    fi
  ) &
done
wait
: > "$OUT/gpu-tests.log"
for i in $(seq 0 $((SHARDS - 1))); do
  echo "=== shard $i ($(wc -l < "/tmp/gpu-shard-$i.txt") tests)" >> "$OUT/gpu-tests.log"
  cat "/tmp/gpu-shard-$i.log" >> "$OUT/gpu-tests.log" 2>/dev/null
done
sum() { grep -hoE "[0-9]+ $1" /tmp/gpu-shard-*.log | awk '{s += $1} END {print s + 0}'; }
echo "gpu tests: $NIDS collected, $(sum passed) passed, $(sum failed) failed, $(sum 'errors?') errors," \
  "$(sum skipped) skipped; $(grep -h 'exit' /tmp/gpu-shard-*.log | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
grep -h '^FAILED\|^ERROR' /tmp/gpu-shard-*.log | head -30 | tee -a "$OUT/summary.txt"
