#!/usr/bin/env bash
# Several GPU rounds in one device command (the H200 machine is lent for a few minutes at a time):
#
#     PARTS="nvfp4 kernel symm integrations" bash lab/gpu_rounds.sh
#
# Each part is one of this directory's round scripts, run with OUT=$OUT/<part> and a timeout of
# its own; a failing or timed-out part does not stop the next. The last lines are a summary.
OUT="${OUT:-/tmp/out}"
PARTS="${PARTS:-kernel symm}"
declare -A SCRIPT=([nvfp4]=gpu_nvfp4_round.sh [kernel]=gpu_kernel_round.sh [symm]=gpu_symm_round.sh
                   [integrations]=integrations_gpu_check.sh)
declare -A LIMIT=([nvfp4]=200 [kernel]=290 [symm]=280 [integrations]=330)
SUMMARY=()
for part in $PARTS; do
  script="benchmarks/${SCRIPT[$part]:-}"
  if [ ! -f "$script" ]; then
    SUMMARY+=("$part: no script $script")
    continue
  fi
  mkdir -p "$OUT/$part"
  start=$SECONDS
  OUT="$OUT/$part" timeout "${PART_LIMIT:-${LIMIT[$part]}}" bash "$script" > "$OUT/$part/stdout.txt" 2>&1
  rc=$?
  SUMMARY+=("$part: rc=$rc in $((SECONDS - start)) s")
  echo "===== $part (rc=$rc, $((SECONDS - start)) s): last lines"
  tail -n 40 "$OUT/$part/stdout.txt"
done
echo "===== summary"
printf '%s\n' "${SUMMARY[@]}"
