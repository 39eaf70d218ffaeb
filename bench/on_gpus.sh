#!/usr/bin/env bash
# Runs one bench command per GPU of a multi-GPU host, side by side, and waits for all:
#   bench/on_gpus.sh LIMIT_S "cmd for GPU 0" "cmd for GPU 1" ...
# Command i sees only GPU i (CUDA_VISIBLE_DEVICES), writes under $OUT/gpu<i> (its own OUT,
# so two benches that start in the same second cannot overwrite each other's stamped
# files) with its output in $OUT/gpu<i>/log.txt, and gets its own copy of the kernel_bench
# cache in $CACHE (the parquet is rewritten whole on each update; two writers would lose
# rows). Each runs under `timeout LIMIT_S`, so a slow one leaves the others' results and
# its own partial files (the benches write what is done after each phase); its cache comes
# back in $OUT/gpu<i>/kernel_bench_cache.
set -uo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bench/on_gpus.sh LIMIT_S CMD [CMD ...]" >&2
    exit 2
fi
limit="$1"
shift
: "${OUT:?OUT must name the results folder}"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$#" -gt "$gpus" ]; then
    echo "bench/on_gpus.sh: $# commands for $gpus GPU(s)" >&2
    exit 2
fi
pids=()
i=0
for cmd in "$@"; do
    dir="$OUT/gpu$i"
    mkdir -p "$dir"
    cache=""
    if [ -n "${CACHE:-}" ] && [ -d "$CACHE" ]; then
        cache="$CACHE.gpu$i"
        rm -rf "$cache" && cp -r "$CACHE" "$cache"
    fi
    (
        export CUDA_VISIBLE_DEVICES=$i OUT="$dir" C="$cache"
        echo "# GPU $i: $cmd" >"$dir/log.txt"
        timeout "$limit" bash -c "$cmd" >>"$dir/log.txt" 2>&1
        echo "# exit $?" >>"$dir/log.txt"
        # The cache as this command left it: the seed of a later call.
        [ -n "$cache" ] && cp -r "$cache" "$dir/kernel_bench_cache"
    ) &
    pids+=($!)
    i=$((i + 1))
done
for pid in "${pids[@]}"; do wait "$pid"; done
for d in "$OUT"/gpu*; do tail -n 1 "$d/log.txt" | sed "s|^|$(basename "$d"): |"; done
