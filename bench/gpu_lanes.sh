#!/usr/bin/env bash
# Runs several benchmark scripts on a 2-GPU machine in two lanes (one per GPU) under one
# wall-clock deadline, and packs everything they write into $OUT/results.tgz.
#   bench/gpu_lanes.sh DEADLINE_S LANE0 LANE1
# A lane is a ';'-separated list of "name|seconds|script args...". Each step gets at most
# its seconds and never runs past the deadline; a step that fails or times out is logged
# and the lane goes on.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
deadline=$(( $(date +%s) + $1 ))
run_lane() {  # gpu, lane spec
    local gpu=$1 IFS=';'
    for step in $2; do
        local name=${step%%|*} rest=${step#*|}
        local seconds=${rest%%|*} cmd=${rest#*|}
        local left=$(( deadline - $(date +%s) ))
        (( left < 20 )) && { echo "[lane $gpu] $name: skipped, ${left}s left"; continue; }
        (( seconds > left )) && seconds=$left
        mkdir -p "$OUT/$name"
        echo "[lane $gpu] $name: start ($seconds s max)"
        local start=$(date +%s)
        IFS=' ' read -r -a argv <<<"$cmd"
        CUDA_VISIBLE_DEVICES=$gpu timeout --kill-after=10 "$seconds" \
            python3 "${argv[@]}" --out "$OUT/$name" >"$OUT/$name/console.log" 2>&1
        echo "[lane $gpu] $name: exit $? after $(( $(date +%s) - start )) s"
        tail -n 30 "$OUT/$name/console.log"
    done
}
run_lane 0 "$2" >"$OUT/lane0.log" 2>&1 &
run_lane 1 "$3" >"$OUT/lane1.log" 2>&1 &
wait
(cd "$OUT" && tar czf results.tgz --exclude=results.tgz --exclude=lane0.log --exclude=lane1.log */ 2>/dev/null && find . -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +)
cat "$OUT/lane0.log" "$OUT/lane1.log"
