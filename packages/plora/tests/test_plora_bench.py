"""bench/plora.py --smoke on the CPU (Triton interpreter): the plan section runs the schedule
`plan_lora_jobs` makes (jobs of two lengths, two GPUs run one after another on this device)
and records predicted beside measured makespan. Times on the CPU mean nothing; what is
checked is that the planner's packs are what ran, each to its jobs' steps."""

import importlib
import json
import sys
from pathlib import Path

import polars as pl
import pytest

pytest.importorskip("transformers")

_BENCH = Path(__file__).resolve().parents[3] / "bench"
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))  # the script imports bench/harness.py as `harness`
harness = importlib.import_module("harness")
bench = harness.load("plora")  # importing it runs nothing


def test_smoke_runs_the_planners_schedule_and_records_predicted_and_measured(tmp_path):
    argv = ["--smoke", "--sections", "plan", "--plan-gpus", "2", "--plan-lengths", "8,4"]
    assert bench.main([*argv, "--budget-s", "600", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("plora_smoke_*.json")
    record = json.loads(result.read_text())
    (summary,) = [r for r in record["plan"] if r["kind"] == "plan"]
    packs = [r for r in record["plan"] if r["kind"] == "plan_pack"]
    assert summary["lengths"] == [4, 8] and summary["gpus"] == 2
    assert summary["throughput_source"].startswith("fit on")  # profiled here: no steps section
    assert summary["packs"] == len(packs) and "error" not in summary
    # What ran is the schedule: its packs, GPU by GPU, each job to its own step count.
    (schedule_file,) = tmp_path.glob("plora_schedule_smoke_*.csv")
    schedule = pl.read_csv(schedule_file)
    assert sorted(schedule["seq_len"].to_list()) == [4, 8]
    planned = {
        tuple(sorted(g["job"].to_list())): g for _, g in schedule.group_by(["gpu", "pack_order"])
    }
    assert sorted(tuple(sorted(p["jobs"])) for p in packs) == sorted(planned)
    by_gpu: dict[int, float] = {}
    for p in packs:
        rows = planned[tuple(sorted(p["jobs"]))]
        assert p["gpu"] == rows["gpu"][0] and p["pack_order"] == rows["pack_order"][0]
        assert p["pack_steps"] == rows["steps"].max() and p["measured_s"] > 0
        assert p["predicted_s"] == pytest.approx(rows["pack_end_s"][0] - rows["pack_start_s"][0])
        assert rows["measured_pack_s"][0] == pytest.approx(p["measured_s"])
        by_gpu[p["gpu"]] = by_gpu.get(p["gpu"], 0.0) + p["measured_s"]
    assert summary["measured_makespan_s"] == pytest.approx(max(by_gpu.values()))
    assert summary["predicted_over_measured"] == pytest.approx(
        summary["predicted_makespan_s"] / summary["measured_makespan_s"]
    )
    assert record["summary"]["plan"][0]["measured_makespan_s"] == summary["measured_makespan_s"]
    # Steady: each composition's first step at its median (on a CPU it may be either way).
    assert summary["measured_steady_makespan_s"] > 0
    assert all(p["steady_s"] + p["first_use_s"] <= p["measured_s"] + 1e-9 for p in packs)


def test_first_step_of_each_pack_composition_is_charged_at_its_steady_step():
    # Jobs leaving a pack change its total rank, and the kernels tune for the new shape on
    # that step: it counts at the composition's median step, the rest is first-use time.
    a, b, c = (0, 1), (1,), (2,)
    steps = [5.0, 1.0, 1.2, 4.0, 0.5, 0.7, 3.0]
    split = bench.steady_split(steps, [True, False, False, True, False, False, True],
                               [a, a, a, b, b, b, c])  # fmt: skip
    # c ran once: charged at the median of every later step (0.85).
    assert split["steady_s"] == pytest.approx(1.1 + 1.0 + 1.2 + 0.6 + 0.5 + 0.7 + 0.85)
    assert split["first_use_s"] == pytest.approx(sum(steps) - split["steady_s"])
    assert split["compositions"] == 3
    assert bench.steady_split([2.0], [True], [a]) == {
        "steady_s": 2.0, "first_use_s": 0.0, "compositions": 1,
    }  # fmt: skip


def test_smoke_fair_baseline_rates_and_ratios(tmp_path):
    """The baseline section: eager and compiled rates at each job's own batch and at the
    largest micro-batch (the cap on a CPU), and the makespan against the old and fair
    sequential baselines (compiled with Dynamo's eager backend in smoke, and said so)."""
    argv = ["--smoke", "--sections", "baseline,makespan", "--budget-s", "600"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("plora_smoke_*.json")
    record = json.loads(result.read_text())
    assert record["meta"]["fair_baseline"]["compile"]["backend"] == "eager"
    jobs = record["jobs"]
    rates = {(r["rank"], r["micro_batch"], r["variant"]): r
             for r in record["baseline"] if r["kind"] == "baseline_rate"}  # fmt: skip
    assert not [r for r in record["baseline"] if "error" in r]
    cap = record["meta"]["fair_baseline"]["micro_batch_cap"]
    for job in jobs:
        for batch in (job["batch_size"], cap):
            for variant in ("eager", "compiled"):
                r = rates[(job["rank"], batch, variant)]
                assert r["samples_per_s"] > 0 and (r["compile_s"] > 0) == (variant == "compiled")
    (makespan,) = record["summary"]["makespan"]
    for policy in ("eager_own", "own", "best"):
        seq_s = makespan[f"{policy}_sequential_s"]
        assert makespan[f"ratio_vs_{policy}"] == pytest.approx(seq_s / makespan["packed_s"])
        fair = record["baseline_makespans"][str(makespan["jobs"])][policy]
        assert fair["makespan_s"] == pytest.approx(seq_s)
        assert fair["samples"] == sum(j["steps"] * j["batch_size"] for j in jobs)
    assert makespan["best_sequential_s"] <= makespan["eager_own_sequential_s"]
    packed = next(r for r in record["makespan"] if r["kind"] == "packed")
    assert packed["steady_s"] + packed["first_use_s"] <= packed["wall_s"] + 1e-9
    assert makespan["ratio_vs_best_steady"] == pytest.approx(
        makespan["best_sequential_s"] / makespan["packed_steady_s"]
    )
    # Compile time is charged only where the compiled variant won, which on a CPU is a
    # matter of timing noise: check the charge against the variants chosen.
    best = record["baseline_makespans"][str(makespan["jobs"])]["best"]
    compiled = any(job["variant"] == "compiled" for job in best["jobs"])
    assert (makespan["best_compile_s"] > 0) == compiled and makespan["best_missing"] == []


def test_smoke_profile_splits_a_packed_step_into_its_phases(tmp_path):
    """The profile section: packed steps of 1 job and the largest pack, and one peft job,
    each with wall time, host time per phase, the top host ops and a table file."""
    assert bench.main(["--smoke", "--sections", "profile", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("plora_smoke_*.json")
    rows = json.loads(result.read_text())["profile"]
    assert [r["what"] for r in rows] == ["packed", "packed", "solo_peft"]
    assert [r["n_adapters"] for r in rows] == [1, 2, 1]
    for row in rows:
        assert row["wall_ms_per_step"] > 0 and row["top_host_ops"]
        assert (tmp_path / row["table"]).read_text().strip()
    for row in rows[:2]:  # runner.packed_train_step labels its phases
        phases = row["host_ms_per_phase"]
        assert set(phases) == set(bench.PHASES) and all(v > 0 for v in phases.values())
        assert phases["plora.forward"] < row["wall_ms_per_step"] * 1.5


def test_smoke_makespan_runs_compiled_packing_beside_eager(tmp_path):
    """`--packed both`: each job count trains packed eagerly and with the forward and loss
    compiled (one after the other, the same jobs and batches), and the summary sets both
    against the best compiled peft rate and compiled packing against eager packing."""
    argv = ["--smoke", "--sections", "baseline,makespan", "--packed", "both", "--baseline-ranks",
            "8", "--no-sequential", "--budget-s", "600", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    (result,) = tmp_path.glob("plora_smoke_*.json")
    record = json.loads(result.read_text())
    runs = {r["kind"]: r for r in record["makespan"]}
    assert set(runs) == {"packed", "packed_compiled"}  # no sequential runs
    assert runs["packed"]["tokens"] == runs["packed_compiled"]["tokens"] > 0
    rates = [r for r in record["baseline"] if r["kind"] == "baseline_rate"]
    assert rates and {r["rank"] for r in rates} == {8}
    best = max((r for r in rates if r["variant"] == "compiled"), key=lambda r: r["tokens_per_s"])
    rows = {r["kind"]: r for r in record["summary"]["packed_vs_compiled_peft"]}
    for kind, run in runs.items():
        assert rows[kind]["steady_tokens_per_s"] == pytest.approx(run["steady_tokens_per_s"])
        assert rows[kind]["ratio_vs_compiled_peft"] == pytest.approx(
            run["steady_tokens_per_s"] / best["tokens_per_s"]
        )
    assert rows["packed_compiled"]["ratio_vs_eager_packing"] == pytest.approx(
        runs["packed_compiled"]["steady_tokens_per_s"] / runs["packed"]["steady_tokens_per_s"]
    )


def test_optimizer_graphs_script_trains_identically_on_the_cpu(tmp_path):
    """bench/plora_optimizer_graphs.py on the CPU (smoke model, stand-in capture): the
    graphed and op-by-op packs must end with identical adapters and gradient norms."""
    script = harness.load("plora_optimizer_graphs")
    assert script.main(["--steps", "3", "--reps", "2", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("plora_optimizer_graphs_*.json")
    (row,) = json.loads(result.read_text())["rows"]
    assert row["max_param_diff"] == 0.0 and row["max_grad_norm_diff"] == 0.0
    assert row["graph_stats"]["captures"] == 1 and row["graph_stats"]["replays"] >= 3


def test_optimizer_graphs_script_ab_interleaves_the_real_step_on_the_cpu(tmp_path):
    """--ab-blocks: whole packed steps with the graphs switched on and off in ABBA blocks,
    each mode timed as often, and the graphed blocks replaying captured steps."""
    script = harness.load("plora_optimizer_graphs")
    argv = ["--steps", "2", "--reps", "1", "--ab-blocks", "2", "--block-steps", "2",
            "--ab-loss", "eager", "--out", str(tmp_path)]  # fmt: skip
    assert script.main(argv) == 0
    (result,) = tmp_path.glob("plora_optimizer_graphs_*.json")
    (ab,) = json.loads(result.read_text())["ab"]
    assert ab["loss"] == "eager" and len(ab["warmup_ms"]) == 3
    assert len(ab["step_ms"]["graphs"]) == len(ab["step_ms"]["eager"]) == 2
    assert len(ab["eager_over_graphs"]) == 2 and all(r > 0 for r in ab["eager_over_graphs"])
    # Warm-up and A/B: 2 + 2 graphed blocks of 2 steps; the first step runs op by op and
    # the second captures, so at least 4 replays follow.
    assert ab["graph_stats"]["captures"] >= 1 and ab["graph_stats"]["replays"] >= 4
