"""`loka lora-plan`: pack LoRA job configurations onto GPUs, minimizing the makespan."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports wait until the command runs: `loka --help` stays fast
    import polars as pl
    from rich.console import Console

    from loka.dispatch.lora_plan import LoraPlan

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
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sample (512)")
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
    parser.add_argument("--solver", choices=("auto", "milp", "greedy"), default="auto")
    parser.add_argument("--time-limit", type=float, default=20.0, help="ILP time limit, s")
    parser.add_argument("--max-pack-size", type=int, default=None, help="most jobs in a pack")
    parser.add_argument(
        "--headroom", type=float, default=0.9, help="fraction of GPU memory a pack may use"
    )
    parser.add_argument("--out", type=Path, help="write the schedule (.csv, .parquet, .json)")
    parser.set_defaults(func=run)


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read a memory size from {text!r}; use e.g. 80GiB, 141GB or 8e10"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from loka.dispatch.lora_plan import (
        MemoryModel,
        ModelShape,
        ThroughputModel,
        plan_lora_jobs,
        read_job_configs,
    )

    console = Console(stderr=True)
    jobs = read_job_configs(args.configs)
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
    """Write atomically (temporary file in the same folder, then rename)."""
    writers = {".csv": schedule.write_csv, ".parquet": schedule.write_parquet}
    writers[".json"] = schedule.write_json
    if path.suffix not in writers:
        raise ValueError(f"{path}: the schedule is written as .csv, .parquet or .json")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        writers[path.suffix](tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _device_memory() -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: give --gpu-memory (e.g. 80GiB)")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def _profile(args, jobs, memory, console):
    import torch
    from transformers import AutoModelForCausalLM

    from loka.dispatch.lora_plan import profile_throughput

    if not torch.cuda.is_available():
        raise SystemExit("--profile needs a CUDA GPU; use --throughput with a recorded table")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()
    with console.status("profiling packed steps") as status:
        throughput, profiles, packs = profile_throughput(
            model,
            jobs,
            args.seq_len,
            on_profile=lambda p: status.update(
                f"profiled {p.n_adapters} job(s), {p.tokens} tokens: {p.step_time_s * 1e3:.1f} ms"
            ),
        )
    return throughput, memory.calibrated([p.to_dict() for p in profiles], packs)


def _print_plan(console: Console, plan: LoraPlan) -> None:
    import polars as pl
    from rich.table import Table

    from loka.dispatch.lora_plan.memory import GIB

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
