"""`plan_lora_jobs`: from LoRA configurations to a schedule of packs (a polars table)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from loka.plora.config import LoraJobConfig, pack_rows
from loka.plora.plan.memory import GIB, MemoryModel
from loka.plora.plan.solver import (
    Assignment,
    PackingProblem,
    candidate_packs,
    improve,
    one_job_per_pack,
    solve_greedy,
    solve_milp,
)
from loka.plora.plan.throughput import ThroughputModel

SOLVERS = ("auto", "milp", "greedy")

SCHEDULE_SCHEMA = {
    "job": pl.String,
    "status": pl.String,  # "planned" or "does_not_fit"
    "gpu": pl.Int32,
    "pack": pl.Int32,  # global pack id
    "pack_order": pl.Int32,  # position of the pack in its GPU's queue
    "rank": pl.Int32,
    "alpha": pl.Float64,
    "lr": pl.Float64,
    "batch_size": pl.Int32,
    "seq_len": pl.Int32,  # the job's tokens per sample
    "steps": pl.Int64,
    "job_tokens": pl.Int64,
    "pack_jobs": pl.Int32,
    "pack_tokens_per_step": pl.Int64,  # all jobs active, pads of shared rows included
    "pack_step_time_s": pl.Float64,
    "pack_start_s": pl.Float64,
    "pack_end_s": pl.Float64,
    "job_end_s": pl.Float64,
    "pack_memory_bytes": pl.Int64,
    "memory_budget_bytes": pl.Int64,
    "reason": pl.String,
}


@dataclass(frozen=True)
class LoraPlan:
    """The schedule (one row per job, `SCHEDULE_SCHEMA`) and how it was reached.

    makespan_s: predicted time until every planned job is done; baseline_makespan_s: the
    same with one job per pack (each job trained alone), on the same GPUs and models.
    """

    schedule: pl.DataFrame
    makespan_s: float
    baseline_makespan_s: float
    solver: str
    throughput_source: str
    memory_source: str
    budget_bytes: int
    num_gpus: int

    @property
    def speedup(self) -> float:
        return self.baseline_makespan_s / self.makespan_s if self.makespan_s > 0 else float("nan")

    @property
    def unfit(self) -> list[str]:
        return self.schedule.filter(pl.col("status") == "does_not_fit")["job"].to_list()

    def packs(self, gpu: int | None = None) -> list[list[str]]:
        """Job names per pack, in the order the packs run (GPU by GPU), for `train_packs`."""
        planned = self.schedule.filter(pl.col("status") == "planned")
        if gpu is not None:
            planned = planned.filter(pl.col("gpu") == gpu)
        ordered = planned.sort(["gpu", "pack_order", "job_end_s", "job"])
        return [
            group["job"].to_list()
            for _, group in ordered.group_by(["gpu", "pack_order"], maintain_order=True)
        ]


def plan_lora_jobs(
    jobs: Sequence[LoraJobConfig],
    memory: MemoryModel,
    throughput: ThroughputModel,
    *,
    gpu_memory_bytes: int,
    num_gpus: int = 1,
    headroom: float = 0.9,
    solver: str = "auto",
    time_limit_s: float = 20.0,
    max_pack_size: int | None = None,
    max_candidates: int = 4000,
    search: bool = True,
) -> LoraPlan:
    """Pack `jobs` onto `num_gpus` GPUs of `gpu_memory_bytes` each, minimizing makespan.

    No pack's predicted memory exceeds `headroom * gpu_memory_bytes`. A job that cannot fit
    even alone is reported with status "does_not_fit" and a reason; the others are planned.
    solver: "milp" (error if it fails), "greedy", or "auto" (the ILP, falling back to
    greedy when it fails or has more than `max_candidates` candidate packs; the better
    of the two is kept). search: then improve the result by local search over packs of any
    jobs (`loka.plora.plan.solver.improve`); its solver name ends in "+ local search" when
    that shortened the makespan. Jobs may have different `seq_len`s: a pack's step time and
    memory count each job's tokens as `loka.plora.config.pack_rows` lays them out.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(
            f"job names must be unique: {sorted({n for n in names if names.count(n) > 1})}"
        )
    budget = int(gpu_memory_bytes * headroom)
    problem = PackingProblem(
        jobs,
        memory,
        throughput,
        num_gpus=num_gpus,
        budget_bytes=budget,
        max_pack_size=max_pack_size,
    )
    fitting = [i for i in range(len(jobs)) if problem.fits((i,))]
    if not fitting:
        assignment, baseline = Assignment((), (), "none (no job fits)"), Assignment((), (), "")
    else:
        baseline = one_job_per_pack(problem, fitting)
        assignment = _solve(problem, fitting, solver, time_limit_s, max_candidates, baseline)
        if search:
            assignment = improve(problem, assignment)
    return LoraPlan(
        schedule=_schedule(problem, assignment),
        makespan_s=problem.makespan(assignment),
        baseline_makespan_s=problem.makespan(baseline),
        solver=assignment.solver,
        throughput_source=throughput.source,
        memory_source=memory.source,
        budget_bytes=budget,
        num_gpus=num_gpus,
    )


def simulate_makespan(
    schedule: pl.DataFrame,
    jobs: Sequence[LoraJobConfig],
    throughput: ThroughputModel,
    seq_len: int,
) -> float:
    """Replay a schedule step by step: each GPU runs its packs in `pack_order`; every step of
    a pack costs the throughput model's time for the jobs still active, and a job leaves
    after its own number of steps. `seq_len` is the length of jobs without their own.
    Returns the busiest GPU's finishing time."""
    by_name = {job.name: job for job in jobs}
    planned = schedule.filter(pl.col("status") == "planned")
    finish = 0.0
    for _, gpu_rows in planned.group_by("gpu"):
        clock = 0.0
        for _, rows in gpu_rows.sort("pack_order").group_by("pack_order", maintain_order=True):
            left = {name: by_name[name].num_steps(seq_len) for name in rows["job"]}
            while left:
                clock += throughput.step_time([by_name[n] for n in left], seq_len)
                left = {n: k - 1 for n, k in left.items() if k > 1}
        finish = max(finish, clock)
    return finish


def _solve(problem, fitting, solver, time_limit_s, max_candidates, baseline) -> Assignment:
    greedy = solve_greedy(problem, fitting)
    if solver == "greedy":
        return _best(problem, greedy, baseline)
    candidates = candidate_packs(problem, fitting, seeds=greedy.packs)
    if len(candidates) > max_candidates:
        reason = f"{len(candidates)} candidate packs > max_candidates {max_candidates}"
        if solver == "milp":
            raise RuntimeError(f"milp not attempted: {reason}")
        return _best(problem, _renamed(greedy, f"greedy ({reason})"), baseline)
    outcome = solve_milp(problem, fitting, candidates, time_limit_s=time_limit_s)
    if outcome.assignment is None:
        if solver == "milp":
            raise RuntimeError(outcome.message)
        return _best(problem, _renamed(greedy, f"greedy ({outcome.message})"), baseline)
    if solver == "milp":
        return outcome.assignment
    milp_solver = outcome.assignment.solver
    greedy = _renamed(greedy, f"greedy (better than {milp_solver})")
    return _best(problem, outcome.assignment, greedy, baseline)


def _best(problem: PackingProblem, *assignments: Assignment) -> Assignment:
    """The first assignment with the smallest makespan: the planner never returns a
    schedule slower than training every job alone."""
    best = min(assignments, key=problem.makespan)
    if best.solver == "one job per pack" and best is not assignments[0]:
        return _renamed(best, f"one job per pack (no packing helps; {assignments[0].solver})")
    return best


def _renamed(assignment: Assignment, solver: str) -> Assignment:
    return Assignment(assignment.packs, assignment.gpus, solver)


def _schedule(problem: PackingProblem, assignment: Assignment) -> pl.DataFrame:
    rows = []
    by_gpu: dict[int, list[tuple[int, ...]]] = {}
    for pack, gpu in zip(assignment.packs, assignment.gpus, strict=True):
        by_gpu.setdefault(gpu, []).append(pack)
    pack_id = 0
    for gpu in sorted(by_gpu):
        clock = 0.0
        # Shortest packs first: the same makespan, and results arrive as early as possible.
        for order, pack in enumerate(sorted(by_gpu[gpu], key=problem.duration)):
            timing = problem.timing(pack)
            tokens = sum(pack_rows([problem.jobs[i] for i in pack], problem.seq_len).tokens)
            for i in pack:
                rows.append(
                    _row(problem, i, "planned", "")
                    | {
                        "gpu": gpu,
                        "pack": pack_id,
                        "pack_order": order,
                        "pack_jobs": len(pack),
                        "pack_tokens_per_step": tokens,
                        "pack_step_time_s": timing.step_time_s,
                        "pack_start_s": clock,
                        "pack_end_s": clock + timing.duration_s,
                        "job_end_s": clock + timing.job_end_s[i],
                        "pack_memory_bytes": problem.bytes(pack),
                    }
                )
            clock += timing.duration_s
            pack_id += 1
    placed = {i for pack in assignment.packs for i in pack}
    for i in range(len(problem.jobs)):
        if i not in placed:
            rows.append(_row(problem, i, "does_not_fit", _unfit_reason(problem, i)))
    return pl.DataFrame(rows, schema=SCHEDULE_SCHEMA)


def _row(problem: PackingProblem, i: int, status: str, reason: str) -> dict:
    job = problem.jobs[i]
    return {
        "job": job.name,
        "status": status,
        "rank": job.rank,
        "alpha": float(job.alpha),
        "lr": float(job.lr),
        "batch_size": job.batch_size,
        "seq_len": problem.length[i],
        "steps": problem.steps[i],
        "job_tokens": problem.steps[i] * job.tokens_per_step(problem.seq_len),
        "memory_budget_bytes": problem.budget_bytes,
        "reason": reason,
    }


def _unfit_reason(problem: PackingProblem, i: int) -> str:
    parts = problem.memory.breakdown([problem.jobs[i]])
    detail = ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items())
    return (
        f"needs {sum(parts.values()) / GIB:.2f} GiB alone ({detail} GiB) > budget "
        f"{problem.budget_bytes / GIB:.2f} GiB; lower batch_size or seq_len, or use a larger GPU"
    )
