"""The LoRA job planner: which LoRA configurations to train together, where and when.

Given LoRA job configurations, the GPUs (count, memory) and two models of the packed
training step (`MemoryModel`: base weights, adapter states, activations; `ThroughputModel`:
fit from profiled steps or a recorded table), `plan_lora_jobs` packs the jobs to minimize
the makespan with an ILP (scipy's milp) or a greedy fallback, and returns the schedule as
a polars table; `LoraPlan.packs()` feeds `loka.plora.train_packs`.
"""

from loka.plora.plan.baseline import (
    fair_sequential_makespan,
    pick_batch_size,
    probe_batch_size,
)
from loka.plora.plan.configs import read_job_configs
from loka.plora.plan.memory import MemoryModel
from loka.plora.plan.profile import profile_throughput, profiling_packs
from loka.plora.plan.schedule import (
    SCHEDULE_SCHEMA,
    LoraPlan,
    plan_lora_jobs,
    simulate_makespan,
)
from loka.plora.plan.shape import ModelShape
from loka.plora.plan.throughput import ThroughputModel

__all__ = [
    "SCHEDULE_SCHEMA",
    "LoraPlan",
    "MemoryModel",
    "ModelShape",
    "ThroughputModel",
    "fair_sequential_makespan",
    "pick_batch_size",
    "plan_lora_jobs",
    "probe_batch_size",
    "profile_throughput",
    "profiling_packs",
    "read_job_configs",
    "simulate_makespan",
]
