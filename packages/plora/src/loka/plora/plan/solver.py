"""Choose packs of LoRA jobs and their GPUs to minimize makespan: an ILP, a greedy fallback.

A pack trains its jobs together until the one with most steps ends; a job that finishes
early leaves the pack, so later steps are cheaper (`pack_timing`). Packs on one GPU run one
after another; the makespan is the busiest GPU's total.

The ILP (scipy.optimize.milp, HiGHS) picks from candidate packs (windows of the jobs sorted
by steps, tokens, rank and length, plus the greedy solution's packs, all within the memory
budget) a set that covers every job once, and assigns each to a GPU, minimizing the largest
GPU load. The greedy places the longest jobs first, each either into an existing pack (if
it fits) or into a new pack on the least-loaded GPU, whichever gives the smaller makespan.
`improve` then searches beyond those packs: from the best assignment found, it moves single
jobs between packs, swaps two jobs, merges two packs or moves a pack to another GPU, taking
the best such move while it shortens the makespan (or, at equal makespan, the total GPU
time); every pack it makes fits the budget, and it never returns a longer makespan than it
started from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from loka.plora.config import LoraJobConfig
from loka.plora.plan.memory import MemoryModel
from loka.plora.plan.throughput import ThroughputModel

Pack = tuple[int, ...]  # sorted job indices


@dataclass(frozen=True)
class PackTiming:
    duration_s: float
    step_time_s: float  # with every job of the pack active
    job_end_s: dict[int, float]  # job index -> when it finishes, from the pack's start


@dataclass(frozen=True)
class Assignment:
    packs: tuple[Pack, ...]
    gpus: tuple[int, ...]  # GPU of each pack
    solver: str


class PackingProblem:
    """The jobs, the models and the budget; caches each pack's timing and memory."""

    def __init__(
        self,
        jobs: Sequence[LoraJobConfig],
        memory: MemoryModel,
        throughput: ThroughputModel,
        *,
        num_gpus: int,
        budget_bytes: int,
        max_pack_size: int | None = None,
    ) -> None:
        if num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
        self.jobs = list(jobs)
        self.memory = memory
        self.throughput = throughput
        self.num_gpus = num_gpus
        self.budget_bytes = budget_bytes
        self.max_pack_size = max_pack_size or len(self.jobs)
        self.seq_len = memory.seq_len
        self.steps = [job.num_steps(self.seq_len) for job in self.jobs]
        self.length = [job.length(self.seq_len) for job in self.jobs]
        self.timing: Callable[[Pack], PackTiming] = cache(self._timing)
        self.bytes: Callable[[Pack], int] = cache(self._bytes)

    def fits(self, pack: Pack) -> bool:
        return len(pack) <= self.max_pack_size and self.bytes(pack) <= self.budget_bytes

    def duration(self, pack: Pack) -> float:
        return self.timing(pack).duration_s

    def makespan(self, assignment: Assignment) -> float:
        return max(self.loads(assignment), default=0.0)

    def loads(self, assignment: Assignment) -> list[float]:
        loads = [0.0] * self.num_gpus
        for pack, gpu in zip(assignment.packs, assignment.gpus, strict=True):
            loads[gpu] += self.duration(pack)
        return loads

    def _bytes(self, pack: Pack) -> int:
        return self.memory.pack_bytes([self.jobs[i] for i in pack])

    def _timing(self, pack: Pack) -> PackTiming:
        active = sorted(pack, key=lambda i: self.steps[i])
        times = self.throughput.leaving_step_times([self.jobs[i] for i in active], self.seq_len)
        clock, done, ends = 0.0, 0, {}
        for k, i in enumerate(active):
            if self.steps[i] != done:  # jobs k, k+1, ... train the steps from done on
                clock += (self.steps[i] - done) * times[k]
                done = self.steps[i]
            ends[i] = clock
        return PackTiming(clock, times[0], ends)


def solve_greedy(problem: PackingProblem, indices: Sequence[int]) -> Assignment:
    order = sorted(
        indices,
        key=lambda i: (-problem.steps[i], -problem.jobs[i].batch_size, problem.jobs[i].name),
    )
    packs: list[Pack] = []
    gpus: list[int] = []
    loads = [0.0] * problem.num_gpus
    for i in order:
        g = min(range(problem.num_gpus), key=loads.__getitem__)
        trial = list(loads)
        trial[g] += problem.duration((i,))
        best = (max(trial), sum(trial), -1, g)
        for q, pack in enumerate(packs):
            grown = tuple(sorted((*pack, i)))
            if not problem.fits(grown):
                continue
            trial = list(loads)
            trial[gpus[q]] += problem.duration(grown) - problem.duration(pack)
            best = min(best, (max(trial), sum(trial), q, gpus[q]))
        _, _, q, g = best
        if q < 0:
            packs.append((i,))
            gpus.append(g)
            loads[g] += problem.duration((i,))
        else:
            grown = tuple(sorted((*packs[q], i)))
            loads[g] += problem.duration(grown) - problem.duration(packs[q])
            packs[q] = grown
    return Assignment(tuple(packs), tuple(gpus), "greedy")


def one_job_per_pack(problem: PackingProblem, indices: Sequence[int]) -> Assignment:
    """The baseline: every job trains alone; longest first onto the least-loaded GPU."""
    return _longest_first([(i,) for i in indices], problem, "one job per pack")


def candidate_packs(
    problem: PackingProblem, indices: Sequence[int], seeds: Sequence[Pack] = ()
) -> list[Pack]:
    """Packs that fit: consecutive runs of the jobs sorted by steps (jobs that end together
    waste least), by tokens per step, by rank and by sequence length (jobs of one length
    pad least), plus `seeds`."""
    orders = [
        sorted(indices, key=lambda i: (-problem.steps[i], problem.jobs[i].name)),
        sorted(
            indices,
            key=lambda i: (-problem.jobs[i].batch_size, -problem.steps[i], problem.jobs[i].name),
        ),
        sorted(
            indices, key=lambda i: (-problem.steps[i], -problem.jobs[i].rank, problem.jobs[i].name)
        ),
        sorted(
            indices,
            key=lambda i: (-problem.length[i], -problem.steps[i], problem.jobs[i].name),
        ),
    ]
    found: set[Pack] = {(i,) for i in indices} | set(seeds)
    for order in orders:
        for start in range(len(order)):
            for end in range(start + 2, min(len(order), start + problem.max_pack_size) + 1):
                pack = tuple(sorted(order[start:end]))
                if not problem.fits(pack):
                    break  # memory only grows with more jobs
                found.add(pack)
    return sorted(found)


@dataclass(frozen=True)
class MilpOutcome:
    assignment: Assignment | None
    message: str


def solve_milp(
    problem: PackingProblem,
    indices: Sequence[int],
    candidates: Sequence[Pack],
    *,
    time_limit_s: float,
) -> MilpOutcome:
    g_count, p_count = problem.num_gpus, len(candidates)
    n_y = p_count * g_count
    durations = np.array([problem.duration(p) for p in candidates])
    # Objective: the makespan C, plus a tiny weight on total GPU time to break ties.
    cost = np.zeros(n_y + 1)
    cost[:n_y] = np.repeat(durations, g_count) * 1e-3 / (g_count * max(1, p_count))
    cost[n_y] = 1.0
    rows, cols, vals, lower, upper = [], [], [], [], []
    row = 0
    position = {job: k for k, job in enumerate(indices)}
    for p, pack in enumerate(candidates):  # every job in exactly one chosen pack
        for job in pack:
            for g in range(g_count):
                rows.append(position[job])
                cols.append(p * g_count + g)
                vals.append(1.0)
    row = len(indices)
    lower += [1.0] * row
    upper += [1.0] * row
    for g in range(g_count):  # load of GPU g <= C
        for p in range(p_count):
            rows.append(row)
            cols.append(p * g_count + g)
            vals.append(durations[p])
        rows.append(row)
        cols.append(n_y)
        vals.append(-1.0)
        lower.append(-np.inf)
        upper.append(0.0)
        row += 1
    for g in range(g_count - 1):  # GPUs are interchangeable: order their loads
        for p in range(p_count):
            rows += [row, row]
            cols += [p * g_count + g, p * g_count + g + 1]
            vals += [durations[p], -durations[p]]
        lower.append(0.0)
        upper.append(np.inf)
        row += 1
    matrix = coo_array((vals, (rows, cols)), shape=(row, n_y + 1)).tocsr()
    integrality = np.ones(n_y + 1)
    integrality[n_y] = 0
    upper_bounds = np.ones(n_y + 1)
    upper_bounds[n_y] = np.inf
    result = milp(
        cost,
        constraints=LinearConstraint(matrix, lower, upper),
        integrality=integrality,
        bounds=Bounds(np.zeros(n_y + 1), upper_bounds),
        options={"time_limit": time_limit_s, "disp": False, "mip_rel_gap": 1e-4},
    )
    if result.x is None:
        return MilpOutcome(
            None, f"milp found no solution (status {result.status}: {result.message})"
        )
    chosen = np.flatnonzero(result.x[:n_y] > 0.5)
    packs = tuple(candidates[k // g_count] for k in chosen)
    gpus = tuple(int(k % g_count) for k in chosen)
    covered = sorted(job for pack in packs for job in pack)
    if covered != sorted(indices):
        return MilpOutcome(None, "milp solution does not cover every job once")
    status = "optimal" if result.status == 0 else "time limit, best found"
    return MilpOutcome(Assignment(packs, gpus, f"milp ({status})"), status)


def _longest_first(packs: Sequence[Pack], problem: PackingProblem, solver: str) -> Assignment:
    loads = [0.0] * problem.num_gpus
    placed: list[tuple[Pack, int]] = []
    for pack in sorted(packs, key=lambda p: -problem.duration(p)):
        g = min(range(problem.num_gpus), key=loads.__getitem__)
        loads[g] += problem.duration(pack)
        placed.append((pack, g))
    return Assignment(tuple(p for p, _ in placed), tuple(g for _, g in placed), solver)


def improve(
    problem: PackingProblem, assignment: Assignment, *, max_evaluations: int = 5_000
) -> Assignment:
    """Local search from `assignment` over packs of any jobs, not only the candidates.

    The moves: a job to another pack or alone onto any GPU, two packs merged, a pack to
    another GPU, two jobs of different packs swapped; a move counts only when its packs fit
    the memory budget. The first move that lowers (makespan, total GPU time) is applied and
    the next scan starts at the pack where it was found, until a whole scan finds none or
    `max_evaluations` moves were looked at (a count, not a clock: the plan does not depend
    on the machine's speed). Returns `assignment` itself when nothing improves it.
    """
    packs = list(assignment.packs)
    gpus = list(assignment.gpus)
    loads = problem.loads(assignment)
    start = max(loads, default=0.0)
    left, moved, offset = max_evaluations, False, 0
    while left > 0:
        current = (max(loads), sum(loads))
        tol = 1e-9 * max(current[0], 1e-30)
        found = None
        for where, removed, added in _moves(problem, packs, gpus, offset):
            left -= 1
            if left < 0:
                break
            if not all(problem.fits(pack) for pack, _ in added):
                continue
            trial = list(loads)
            for q in removed:
                trial[gpus[q]] -= problem.duration(packs[q])
            for pack, g in added:
                trial[g] += problem.duration(pack)
            key = (max(trial), sum(trial))
            # Shorter makespan, or the same (never longer by a rounding) and less GPU time.
            if key[0] < current[0] - tol or (key[0] <= current[0] and key[1] < current[1] - tol):
                found = (where, removed, added)
                break
        if found is None:
            break
        offset, removed, added = found
        kept = [q for q in range(len(packs)) if q not in removed]
        packs = [packs[q] for q in kept] + [pack for pack, _ in added]
        gpus = [gpus[q] for q in kept] + [g for _, g in added]
        loads = problem.loads(Assignment(tuple(packs), tuple(gpus), ""))
        moved = True
    result = Assignment(tuple(packs), tuple(gpus), f"{assignment.solver} + local search")
    if not moved or problem.makespan(result) > start:
        return assignment
    return result


Move = tuple[int, tuple[int, ...], tuple[tuple[Pack, int], ...]]  # (pack, removed, added)


def _moves(
    problem: PackingProblem, packs: list[Pack], gpus: list[int], offset: int
) -> Iterator[Move]:
    """Every move of `improve` from this state, the packs taken from `offset` on (then
    wrapping round), cheapest kinds first: (the pack it starts from, the indices of the
    packs it removes, the packs it adds with their GPUs)."""
    n_packs, n_gpus = len(packs), problem.num_gpus
    order = [(offset + k) % n_packs for k in range(n_packs)] if n_packs else []
    for p in order:  # one job to another pack, or alone onto any GPU
        for job in packs[p]:
            others = tuple(i for i in packs[p] if i != job)
            kept = ((others, gpus[p]),) if others else ()
            for q in range(n_packs):
                if q != p:
                    yield p, (p, q), (*kept, (tuple(sorted((*packs[q], job))), gpus[q]))
            for g in range(n_gpus):
                if others or g != gpus[p]:
                    yield p, (p,), (*kept, ((job,), g))
    for p in order:  # two packs merged, on either's GPU; a pack to another GPU
        for q in range(n_packs):
            if q != p:
                yield p, (p, q), ((tuple(sorted((*packs[p], *packs[q]))), gpus[p]),)
        for g in range(n_gpus):
            if g != gpus[p]:
                yield p, (p,), ((packs[p], g),)
    for p in order:  # two jobs of different packs swapped
        for q in range(p + 1, n_packs):
            for a in packs[p]:
                for b in packs[q]:
                    one = tuple(sorted((*(i for i in packs[p] if i != a), b)))
                    two = tuple(sorted((*(i for i in packs[q] if i != b), a)))
                    yield p, (p, q), ((one, gpus[p]), (two, gpus[q]))
