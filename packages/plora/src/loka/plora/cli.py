"""`loka lora-plan`: pack LoRA job configurations onto GPUs, minimizing the makespan."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports wait until the command runs: `loka --help` stays fast
    import polars as pl
    from rich.console import Console

    from loka.plora.plan import LoraPlan

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lora-plan",
        help="plan packs of LoRA jobs (PLoRA) to minimize the makespan",
        description=(
            "Pack LoRA job configurations (a JSON/YAML list or a CSV, one job per row, with "
            "name, rank, alpha, lr, batch_size and steps or tokens) onto GPUs so that every "
            "job finishes as early as possible without exceeding GPU memory."
        ),
    )
    parser.add_argument("configs", type=Path, help="job configurations (.json, .yaml, .csv)")
    parser.add_argument(
        "--model",
        required=True,
        type=Path,
        help="the base model: a Hugging Face checkpoint folder or its config.json",
    )
    parser.add_argument("--gpus", type=int, default=1, help="number of GPUs (default 1)")
    parser.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        default=None,
        help="memory per GPU, e.g. 80GiB or 141GB (default: the current CUDA device's)",
    )
    parser.add_argument(
        "--seq-len", type=int, default=512, help="tokens per sample of jobs without a seq_len (512)"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--throughput",
        type=Path,
        help="recorded table of profiled steps to fit the throughput model on (csv/json/parquet)",
    )
    source.add_argument(
        "--profile",
        action="store_true",
        help="load the model and profile a few packed steps on this machine's GPU",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --profile: time compiled steps, as RunnerConfig(compile=True) trains them",
    )
    parser.add_argument("--solver", choices=("auto", "milp", "greedy"), default="auto")
    parser.add_argument("--time-limit", type=float, default=20.0, help="ILP time limit, s")
    parser.add_argument("--max-pack-size", type=int, default=None, help="most jobs in a pack")
    parser.add_argument(
        "--headroom", type=float, default=0.9, help="fraction of GPU memory a pack may use"
    )
    parser.add_argument("--out", type=Path, help="write the schedule (.csv, .parquet, .json)")
    parser.set_defaults(func=run)


# Sanity bounds: beyond them a value is a typo, and the arithmetic after it overflows.
_MAX_GPU_MEMORY = 2**50  # 1 PiB per GPU
_MAX_GPUS = 65536
_MAX_TOKENS_PER_STEP = 2**31 - 1  # a step's M: no GEMM takes more rows


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read a memory size from {text!r}; use e.g. 80GiB, 141GB or 8e10"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not value < _MAX_GPU_MEMORY:  # 1e400 parses as inf
        raise argparse.ArgumentTypeError(f"memory size {text!r} is more than 1 PiB")
    return int(value)


def check_args(args: argparse.Namespace) -> None:
    """Refuse values no plan can be made with, before anything is read or computed."""
    if not 1 <= args.gpus <= _MAX_GPUS:
        raise ValueError(f"--gpus must be in [1, {_MAX_GPUS}], got {args.gpus}")
    if args.gpu_memory is not None and args.gpu_memory < 1:
        raise ValueError(
            f"--gpu-memory must be a positive size (e.g. 80GiB), got {args.gpu_memory}; "
            "leave it out to use the current CUDA device's"
        )
    if not 1 <= args.seq_len <= _MAX_TOKENS_PER_STEP:
        raise ValueError(f"--seq-len must be in [1, {_MAX_TOKENS_PER_STEP}], got {args.seq_len}")
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise ValueError(
            f"--time-limit must be a positive number of seconds, got {args.time_limit}"
        )
    if args.compile and not args.profile:
        raise ValueError("--compile times compiled steps and needs --profile")
    if args.max_pack_size is not None and args.max_pack_size < 1:
        raise ValueError(f"--max-pack-size must be at least 1, got {args.max_pack_size}")
    if not (math.isfinite(args.headroom) and 0 < args.headroom <= 1):
        raise ValueError(f"--headroom is a fraction of GPU memory in (0, 1], got {args.headroom}")
    if args.out is not None:
        if args.out.suffix not in (".csv", ".parquet", ".json"):
            raise ValueError(
                f"--out {args.out}: the schedule is written as .csv, .parquet or .json"
            )
        if args.out.is_dir():
            raise ValueError(f"--out {args.out} is a directory; give a file name")


def check_jobs(path: Path, jobs: list, seq_len: int) -> None:
    for job in jobs:
        tokens = job.tokens_per_step(seq_len)
        if tokens > _MAX_TOKENS_PER_STEP:
            raise ValueError(
                f"{path}: job {job.name!r}: batch_size {job.batch_size} x seq_len "
                f"{job.length(seq_len)} = "
                f"{tokens} tokens per step, more than any GEMM takes ({_MAX_TOKENS_PER_STEP})"
            )
        if job.rank > _MAX_TOKENS_PER_STEP:
            raise ValueError(f"{path}: job {job.name!r}: rank {job.rank} is not a LoRA rank")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from loka.plora.plan import (
        MemoryModel,
        ModelShape,
        ThroughputModel,
        plan_lora_jobs,
        read_job_configs,
    )

    check_args(args)
    console = Console(stderr=True)
    jobs = read_job_configs(args.configs)
    check_jobs(args.configs, jobs, args.seq_len)
    shape = ModelShape.from_hf_config(args.model)
    memory = MemoryModel(shape, seq_len=args.seq_len)
    gpu_memory = args.gpu_memory or _device_memory()
    if args.throughput is not None:
        throughput = ThroughputModel.from_table(args.throughput)
    elif args.profile:
        throughput, memory = _profile(args, jobs, memory, console)
    else:
        throughput = ThroughputModel.analytic(shape, args.seq_len)
        console.print(
            "[yellow]No --throughput table or --profile: step times are an analytic "
            "estimate, not measurements.[/yellow]"
        )
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=console) as progress:
        progress.add_task(f"planning {len(jobs)} jobs on {args.gpus} GPU(s)", total=None)
        plan = plan_lora_jobs(
            jobs,
            memory,
            throughput,
            gpu_memory_bytes=gpu_memory,
            num_gpus=args.gpus,
            headroom=args.headroom,
            solver=args.solver,
            time_limit_s=args.time_limit,
            max_pack_size=args.max_pack_size,
        )
    _print_plan(console, plan)
    if args.out is not None:
        write_schedule(plan.schedule, args.out)
        console.print(f"schedule written to {args.out}")
    return 1 if plan.unfit else 0


def write_schedule(schedule: pl.DataFrame, path: Path) -> None:
    """Write atomically (temporary file in the same folder, then rename), with the mode an
    ordinary new file gets."""
    writers = {".csv": schedule.write_csv, ".parquet": schedule.write_parquet}
    writers[".json"] = schedule.write_json
    if path.suffix not in writers:
        raise ValueError(f"{path}: the schedule is written as .csv, .parquet or .json")
    from loka.schema import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, writers[path.suffix])  # mode: an ordinary file's under the umask


def _device_memory() -> int:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("no CUDA device here: give --gpu-memory (e.g. 80GiB)")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def _profile(args, jobs, memory, console):
    import torch
    from transformers import AutoModelForCausalLM

    from loka.plora.plan import profile_throughput

    if not torch.cuda.is_available():
        raise ValueError("--profile needs a CUDA GPU; use --throughput with a recorded table")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()
    with console.status("profiling packed steps") as status:
        throughput, profiles, packs = profile_throughput(
            model,
            jobs,
            args.seq_len,
            compile=args.compile,
            on_profile=lambda p: status.update(
                f"profiled {p.n_adapters} job(s), {p.tokens} tokens: {p.step_time_s * 1e3:.1f} ms"
            ),
        )
    return throughput, memory.calibrated([p.to_dict() for p in profiles], packs)


def _print_plan(console: Console, plan: LoraPlan) -> None:
    import polars as pl
    from rich.table import Table

    from loka.plora.plan.memory import GIB

    planned = plan.schedule.filter(pl.col("status") == "planned")
    table = Table(title="LoRA packs", title_justify="left")
    for column in (
        "GPU",
        "#",
        "jobs",
        "tokens/step",
        "step (ms)",
        "memory (GiB)",
        "start (s)",
        "end (s)",
    ):
        table.add_column(column, justify="left" if column == "jobs" else "right")
    for (gpu, order), rows in planned.group_by(["gpu", "pack_order"], maintain_order=True):
        first = rows.row(0, named=True)
        table.add_row(
            str(gpu),
            str(order),
            ", ".join(rows["job"].to_list()),
            str(first["pack_tokens_per_step"]),
            f"{first['pack_step_time_s'] * 1e3:.1f}",
            f"{first['pack_memory_bytes'] / GIB:.1f}",
            f"{first['pack_start_s']:.1f}",
            f"{first['pack_end_s']:.1f}",
        )
    console.print(table)
    console.print(
        f"makespan [bold]{plan.makespan_s:.1f} s[/bold] vs {plan.baseline_makespan_s:.1f} s "
        f"training each job alone ({plan.speedup:.2f}x); solver: {plan.solver}; "
        f"budget {plan.budget_bytes / GIB:.1f} GiB per GPU"
    )
    console.print(f"step times: {plan.throughput_source}; memory: {plan.memory_source}")
    for row in plan.schedule.filter(pl.col("status") == "does_not_fit").iter_rows(named=True):
        console.print(f"[red]{row['job']} does not fit:[/red] {row['reason']}")
