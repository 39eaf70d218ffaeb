"""`loka probe`: train a zoo model for a few steps with Probe attached; save its tables."""

from __future__ import annotations

import argparse
from pathlib import Path

from loka.dispatch.cli._common import fail, use_interpreter_without_gpu


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="profile every GEMM site of a zoo model under each FP8 recipe (Probe)",
        description="Train a loka.zoo model with Probe attached and write its sites, "
        "tensor_stats and site_errors tables (parquet) into --out.",
    )
    # Named here, not imported: `loka --help` loads no torch (a test keeps them in step).
    parser.add_argument("model", help="zoo model: dlrm, dhen, wukong, interformer, hstu, sasrec")
    parser.add_argument("--preset", default="tiny",
                        help="tiny (CPU), base, large or xl (dhen, wukong, interformer, hstu); "
                             "default tiny")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--every", type=int, default=1, help="sample one step in N (default 1)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model's weights and data (default 0)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("loka-probe"), help="output folder")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    use_interpreter_without_gpu()
    import torch

    from loka.dispatch.console import console, progress_bar

    try:
        from loka.dispatch.workloads import probe_zoo
        from loka.probe import ProbeConfig
    except ImportError as exc:
        return fail(f"loka probe needs loka-probe and loka-zoo (the demo extra): {exc}")
    if args.steps < 1:
        return fail(f"--steps must be at least 1, got {args.steps}")
    import loka.zoo as zoo

    if args.model not in zoo.MODELS:  # before the progress bar is drawn
        return fail(f"no zoo model {args.model!r}; choose one of {', '.join(zoo.MODELS)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        config = ProbeConfig(
            every=args.every, warmup_steps=0, max_sites_per_step=None, queue_size=max(2, args.steps)
        )
        with progress_bar(f"probing {args.model} ({args.preset})", args.steps) as update:
            tables = probe_zoo(
                args.model, args.preset, steps=args.steps, device=device, seed=args.seed,
                batch_size=args.batch_size, probe_config=config, autocast=device != "cpu",
                out=args.out, on_step=lambda i, loss: update(i + 1, detail=f"loss {loss:.4f}"),
            )  # fmt: skip
    except (ValueError, TypeError) as exc:
        return fail(str(exc))
    errors = tables["site_errors"]
    counts = errors.group_by("pass", "verdict").len().sort("pass", "verdict")
    console.print(f"{tables['sites'].height} GEMM sites; (site, recipe) verdicts per pass:")
    for row in counts.iter_rows(named=True):
        console.print(f"  {row['pass']:<6} {row['verdict']:<10} {row['len']}")
    console.print(f"wrote sites, tensor_stats and site_errors to {args.out}/")
    return 0
