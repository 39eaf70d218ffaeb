"""The fair sequential baseline's bookkeeping (`loka.plora.plan.baseline`): which micro-batch
the memory probe settles on, and the sequential makespan under each policy."""

import math

import pytest

from loka.plora import LoraJobConfig
from loka.plora.plan import fair_sequential_makespan, pick_batch_size, probe_batch_size

GB = 1e9


def linear_peak(fixed, per_sample, limit):
    """A device where a step of b samples peaks at fixed + per_sample * b, and fails (out of
    memory) past `limit` bytes; counts the probes."""
    calls = []

    def measure(b):
        calls.append(b)
        peak = fixed + per_sample * b
        return None if peak > limit else peak

    return measure, calls


def test_pick_batch_size_extrapolates_and_respects_measurements():
    assert pick_batch_size({}, 10 * GB, 64) == 1  # nothing measured: probe 1 first
    # fixed 2 GB + 1 GB per sample: 8 fits a 10 GB budget (10 GB), 16 does not.
    assert pick_batch_size({1: 3 * GB, 2: 4 * GB}, 10 * GB, 64) == 8
    assert pick_batch_size({1: 3 * GB, 2: 4 * GB}, 10 * GB, 4) == 4  # the cap
    assert pick_batch_size({1: 3 * GB, 2: 4 * GB}, 10 * GB, 6) == 4  # cap not a power of two
    # A measured failure bounds the unmeasured batches above it, whatever the line says.
    assert pick_batch_size({1: 3 * GB, 2: 4 * GB, 8: None}, 10 * GB, 64) == 4
    # A measured peak over the budget counts as not fitting.
    assert pick_batch_size({1: 3 * GB, 2: 4 * GB, 8: 11 * GB}, 10 * GB, 64) == 4
    # One point: peak taken proportional to the batch (conservative).
    assert pick_batch_size({1: 3 * GB}, 10 * GB, 64) == 2
    assert pick_batch_size({1: None}, 10 * GB, 64) is None
    assert pick_batch_size({1: 11 * GB}, 10 * GB, 64) is None
    with pytest.raises(ValueError, match="cap"):
        pick_batch_size({}, GB, 0)


def test_probe_finds_the_largest_fitting_power_of_two_in_few_probes():
    measure, calls = linear_peak(2 * GB, 1 * GB, 10 * GB)
    batch, peaks = probe_batch_size(measure, 10 * GB, 64)
    assert batch == 8 and peaks[8] == 10 * GB
    assert calls == [1, 2, 8]  # jumps straight to the extrapolated answer
    # The line under-estimates (memory grows faster than linear past 8): the out-of-memory
    # answer is recorded and the probe settles below it.
    calls = []

    def superlinear(b):
        calls.append(b)
        peak = 2 * GB + 1 * GB * b + (0 if b <= 4 else 3 * GB)
        return None if peak > 12 * GB else peak

    batch, peaks = probe_batch_size(superlinear, 12 * GB, 64)
    assert batch == 4 and peaks[8] is None and calls[:2] == [1, 2]
    assert probe_batch_size(lambda b: None, 10 * GB, 64) == (None, {1: None})
    assert probe_batch_size(lambda b: GB, 10 * GB, 1) == (1, {1: GB})


def rate(rank, micro_batch, variant, samples_per_s, compile_s=0.0, seq_len=16):
    return {"rank": rank, "micro_batch": micro_batch, "variant": variant,
            "tokens_per_s": samples_per_s * seq_len, "compile_s": compile_s}  # fmt: skip


JOBS = [
    LoraJobConfig("a", rank=8, alpha=16, lr=1e-4, batch_size=1, steps=12),  # 12 samples
    LoraJobConfig("b", rank=8, alpha=16, lr=1e-4, batch_size=2, steps=10),  # 20 samples
    LoraJobConfig("c", rank=16, alpha=16, lr=1e-4, batch_size=4, steps=5),  # 20 samples
]
RATES = [
    rate(8, 1, "eager", 10.0), rate(8, 1, "compiled", 20.0, compile_s=30.0),
    rate(8, 2, "eager", 20.0), rate(8, 2, "compiled", 40.0, compile_s=31.0),
    rate(8, 8, "eager", 80.0), rate(8, 8, "compiled", 100.0, compile_s=33.0),
    rate(16, 4, "eager", 40.0), rate(16, 4, "compiled", 60.0, compile_s=40.0),
    rate(16, 8, "eager", 50.0),  # compiled at 8 failed (out of memory): absent
]  # fmt: skip


def test_fair_makespan_per_policy_keeps_samples_and_accounts_steps():
    old = fair_sequential_makespan(JOBS, RATES, 16, policy="eager_own")
    assert old["makespan_s"] == pytest.approx(12 / 10 + 20 / 20 + 20 / 40)
    assert old["compile_s"] == 0 and old["optimizer_steps_at_micro_batch"] == 27

    own = fair_sequential_makespan(JOBS, RATES, 16, policy="own")
    assert own["makespan_s"] == pytest.approx(12 / 20 + 20 / 40 + 20 / 60)
    assert own["compile_s"] == pytest.approx(30 + 31 + 40)  # one compile per shape used
    assert own["optimizer_steps_at_micro_batch"] == own["optimizer_steps"] == 27

    best = fair_sequential_makespan(JOBS, RATES, 16)
    rows = {r["job"]: r for r in best["jobs"]}
    # Jobs a and b share one compiled shape (rank 8, micro-batch 8): one compile charged.
    assert {k: (r["variant"], r["micro_batch"]) for k, r in rows.items()} == {
        "a": ("compiled", 8), "b": ("compiled", 8), "c": ("compiled", 4)}  # fmt: skip
    assert best["compile_s"] == pytest.approx(33 + 40)
    assert best["makespan_s"] == pytest.approx(12 / 100 + 20 / 100 + 20 / 60)
    assert best["makespan_with_compile_s"] == pytest.approx(best["makespan_s"] + 73)
    assert best["samples"] == old["samples"] == 52  # samples never change
    # Fewer, bigger steps: a 12 -> 2 steps (8 + 4 samples), b 10 -> 3, c stays 5.
    assert (rows["a"]["steps_at_micro_batch"], rows["a"]["last_step_samples"]) == (2, 4)
    assert best["optimizer_steps_at_micro_batch"] == 2 + 3 + 5
    # Whole steps: every step charged as a full micro-batch (16 + 24 samples at 100/s).
    assert best["makespan_whole_steps_s"] == pytest.approx(16 / 100 + 24 / 100 + 20 / 60)
    assert best["makespan_whole_steps_s"] >= best["makespan_s"]
    assert best["makespan_s"] <= own["makespan_s"] <= old["makespan_s"]


def test_fair_makespan_over_gpus_lengths_and_missing_rates():
    two = fair_sequential_makespan(JOBS, RATES, 16, policy="eager_own", num_gpus=2)
    # Longest first onto the least-loaded GPU: a (1.2 s) | b (1.0 s) + c (0.5 s).
    assert two["makespan_s"] == pytest.approx(1.5) and sorted(two["by_gpu_s"]) == [1.2, 1.5]
    # A job at another length is charged its tokens at the rate's tokens/s, and flagged.
    short = [LoraJobConfig("s", rank=8, alpha=16, lr=1e-4, batch_size=1, steps=12, seq_len=8)]
    (row,) = fair_sequential_makespan(short, RATES, 16, policy="eager_own")["jobs"]
    assert row["approx_length"] and row["time_s"] == pytest.approx(12 * 8 / 160)
    # No rate for a job: listed, and no makespan rather than a wrong one.
    lone = [*JOBS, LoraJobConfig("d", rank=64, alpha=16, lr=1e-4, batch_size=1, steps=1)]
    out = fair_sequential_makespan(lone, RATES, 16)
    assert out["missing"] == ["d"] and out["makespan_s"] is None
    assert math.isclose(out["total_s"], fair_sequential_makespan(JOBS, RATES, 16)["total_s"])
    with pytest.raises(ValueError, match="policy"):
        fair_sequential_makespan(JOBS, RATES, 16, policy="fastest")
    with pytest.raises(ValueError, match="num_gpus"):
        fair_sequential_makespan(JOBS, RATES, 16, num_gpus=0)
