"""The fair sequential baseline (issue 19): every LoRA job trained alone, one after another,
at the best measured rate of a single-adapter trainer (peft, eager or compiled, at the job's
own batch or at a larger micro-batch that fills the GPU).

Pure bookkeeping over measured rates, no torch: `bench/plora.py --sections baseline`
measures the rates on the GPU, these functions pick the micro-batch to probe and turn the
rates into a makespan.

A rate is a mapping with `rank`, `micro_batch` (samples per optimizer step), `variant`
(e.g. "eager", "compiled"), `tokens_per_s` (steady state, at the bench's sequence length)
and `compile_s` (one-time cost of the shape; 0 for eager).

Training semantics: a job is `steps x batch_size` samples. At its own batch (policies
"eager_own" and "own") it takes exactly its steps, so it optimizes exactly as configured.
At a larger micro-batch B ("best") the same samples take ceil(samples / B) optimizer steps
(fewer, bigger steps: a different optimization, lr not rescaled); the per-job rows say
how many. Time is samples / the steady-state rate, which is a lower bound on the real time
(no ramp, and a last step of fewer than B samples is charged at the full-batch rate), so
the baseline errs in its own favour.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from loka.plora.config import LoraJobConfig

POLICIES = ("eager_own", "own", "best")


def pick_batch_size(peaks: Mapping[int, float | None], budget_bytes: float, cap: int) -> int | None:
    """The largest power of two <= `cap` whose training step should fit `budget_bytes`.

    `peaks` maps micro-batches already tried to their measured peak memory (None: it did not
    fit, out of memory). A measured batch fits when its peak is within the budget; an
    unmeasured one when it is smaller than every batch that failed and its peak, extrapolated
    linearly (fixed + per sample) from the two largest batches that fit, is within the budget
    (from one batch: peak proportional to the batch, which over-estimates). With nothing
    measured the answer is 1 (probe it first); None when not even 1 fits. A caller probes the
    answer until it is a measured batch (`probe_batch_size`)."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    if not peaks:
        return 1

    def fits(p):
        return p is not None and p <= budget_bytes

    good = sorted(b for b, p in peaks.items() if fits(p))
    failed = min((b for b, p in peaks.items() if not fits(p)), default=math.inf)
    if len(good) >= 2:
        (b1, p1), (b2, p2) = [(b, peaks[b]) for b in good[-2:]]
        slope = max((p2 - p1) / (b2 - b1), 0.0)
        fixed = p2 - slope * b2
    elif good:
        slope, fixed = peaks[good[0]] / good[0], 0.0
    else:
        return None if 1 in peaks else 1
    b = 1 << (cap.bit_length() - 1)
    while b >= 1:
        if b in peaks:
            if fits(peaks[b]):
                return b
        elif b < failed and fixed + slope * b <= budget_bytes:
            return b
        b //= 2
    return None


def probe_batch_size(
    measure: Callable[[int], float | None], budget_bytes: float, cap: int
) -> tuple[int | None, dict[int, float | None]]:
    """Probe micro-batches with `measure(b) -> peak bytes | None (out of memory)`: 1 and 2,
    then whatever `pick_batch_size` proposes until its answer was measured and fits.
    Returns (the batch or None, every peak measured); at most ~2 log2(cap) probes."""
    peaks: dict[int, float | None] = {}
    for b in (1, 2):
        if b <= cap and (b == 1 or peaks[1] is not None):
            peaks[b] = measure(b)
    while True:
        b = pick_batch_size(peaks, budget_bytes, cap)
        if b is None or b in peaks:
            return b, peaks
        peaks[b] = measure(b)


def job_samples(job: LoraJobConfig, seq_len: int) -> int:
    """Samples the job trains on: its steps x its batch size (kept by every policy)."""
    return job.num_steps(seq_len) * job.batch_size


def fair_sequential_makespan(
    jobs: Sequence[LoraJobConfig],
    rates: Iterable[Mapping[str, Any]],
    seq_len: int,
    *,
    policy: str = "best",
    num_gpus: int = 1,
) -> dict[str, Any]:
    """Makespan of `jobs` trained one after another (longest first onto the least-loaded of
    `num_gpus` GPUs), each at its best allowed rate among `rates` (see the module doc).

    policy: "eager_own": the eager rate at the job's own batch (the old baseline, from
    steady-state rates); "own": the best variant at the job's own batch (same optimizer
    steps as configured); "best": the best variant at any micro-batch measured for the job's
    rank (same samples, possibly fewer steps). Compile time is charged once per distinct
    (rank, micro-batch, variant) shape used and reported apart (`compile_s`), not in the GPU
    loads. A job whose length differs from `seq_len` (where the rates were measured) is
    charged its tokens at the rate's tokens/s (`approx_length` in its row).

    Returns makespan_s (samples at the steady rate: a lower bound), makespan_whole_steps_s
    (every step of the chosen micro-batch charged in full, the last one too: an upper
    bound, on the same GPU loads), compile_s, makespan_with_compile_s, total_s (sum over
    jobs), by_gpu_s, samples, optimizer_steps (as configured) and
    optimizer_steps_at_micro_batch, jobs (one row per job: its samples, steps, chosen rate,
    steps at that micro-batch, time_s) and missing (jobs without an allowed rate;
    makespan_s is None when any)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    rates = [r for r in rates if r.get("tokens_per_s")]
    rows, missing = [], []
    for job in jobs:
        allowed = [
            r
            for r in rates
            if r["rank"] == job.rank
            and (policy == "best" or r["micro_batch"] == job.batch_size)
            and (policy != "eager_own" or r["variant"] == "eager")
        ]
        if not allowed:
            missing.append(job.name)
            continue
        rate = max(allowed, key=lambda r: (r["tokens_per_s"], -r["micro_batch"]))
        samples, length, micro = job_samples(job, seq_len), job.length(seq_len), rate["micro_batch"]
        steps_at = math.ceil(samples / micro)
        rows.append({
            "job": job.name, "rank": job.rank, "batch_size": job.batch_size, "seq_len": length,
            "steps": job.num_steps(seq_len), "samples": samples, "tokens": samples * length,
            "variant": rate["variant"], "micro_batch": micro, "steps_at_micro_batch": steps_at,
            "last_step_samples": samples - (steps_at - 1) * micro,
            "tokens_per_s": rate["tokens_per_s"], "time_s": samples * length / rate["tokens_per_s"],
            "whole_steps_time_s": steps_at * micro * length / rate["tokens_per_s"],
            "approx_length": length != seq_len,
        })  # fmt: skip
    loads, whole = [0.0] * num_gpus, [0.0] * num_gpus
    for row in sorted(rows, key=lambda r: -r["time_s"]):
        gpu = min(range(num_gpus), key=loads.__getitem__)
        loads[gpu] += row["time_s"]
        whole[gpu] += row["whole_steps_time_s"]
        row["gpu"] = gpu
    shapes = {
        (r["rank"], r["micro_batch"], r["variant"])
        for r in rows  # the chosen shapes; their compile time from the rate records
    }
    compile_by_shape = {
        (r["rank"], r["micro_batch"], r["variant"]): r.get("compile_s") or 0.0 for r in rates
    }
    compile_s = sum(compile_by_shape[s] for s in shapes)
    complete = rows and not missing
    makespan = max(loads) if complete else None
    return {
        "policy": policy, "num_gpus": num_gpus, "makespan_s": makespan,
        "compile_s": compile_s,
        "makespan_with_compile_s": None if makespan is None else makespan + compile_s,
        "makespan_whole_steps_s": max(whole) if complete else None,
        "total_s": sum(r["time_s"] for r in rows), "by_gpu_s": loads,
        "samples": sum(r["samples"] for r in rows),
        "optimizer_steps": sum(r["steps"] for r in rows),
        "optimizer_steps_at_micro_batch": sum(r["steps_at_micro_batch"] for r in rows),
        "jobs": rows, "missing": missing,
    }  # fmt: skip
