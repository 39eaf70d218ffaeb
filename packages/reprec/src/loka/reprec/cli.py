"""`loka reprec`: the REPREC pipeline (loka.reprec) with its baselines on an Amazon
dataset: train SASRec, pretrain a small backbone unless one is given, train the injector and
LoRA, evaluate, write the results table.

The `loka` command (loka-dispatch) finds it through this package's `loka.commands` entry
point; bad input is raised as `ValueError` / `OSError`, which it prints as one line."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports wait until the command runs: `loka --help` stays fast
    from loka.reprec import RepRecConfig, RepRecReport

_METHODS = ("sasrec", "zero_shot", "reprec", "lora", "reprec_cheap")


def _csv(kind: type, choices: tuple[str, ...] | None = None):
    def parse(text: str) -> tuple:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
        bad = [v for v in values if choices is not None and v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list{f' of {list(choices)}' if choices else ''}, "
                f"got {text!r}"
            )
        return values

    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "reprec",
        help="REPREC: a frozen LLM conditioned by a SASRec user embedding, vs LoRA and SASRec",
        description=(
            "Train SASRec on the training split, pretrain a small Llama on the training "
            "histories as text (or load --backbone, any local Hugging Face causal LM), train "
            "the REPREC injector and the baselines (zero-shot, LoRA r=8 on q/v, REPREC on "
            "short histories), rank each test item against 200 seeded negatives (100 by "
            "popularity + 100 uniform), and write the table (HR@5, NDCG@5, HR@10, NDCG@10, "
            "MRR per activity group)."
        ),
    )
    data = parser.add_argument_group("data and run")
    data.add_argument("--data", "--dataset", dest="dataset", default="beauty",
                      help="a 5-core file (user item item ...), or a name found in --data-dir "
                      "(beauty, sports, or a file's name without .txt)")  # fmt: skip
    data.add_argument("--data-dir", default=None, help="folder of the 5-core files")
    data.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    data.add_argument("--bf16", action="store_true", help="bfloat16 autocast (CUDA)")
    data.add_argument("--seed", type=int, default=0, help="seed of the runs (default 0)")
    data.add_argument("--methods", type=_csv(str, _METHODS), default=_METHODS,
                      help=f"comma-separated subset of {','.join(_METHODS)}")  # fmt: skip
    data.add_argument("--out", type=Path, default=Path("reprec-results"),
                      help="folder for reprec.json and reprec.csv")  # fmt: skip
    encoder = parser.add_argument_group("user encoder (SASRec)")
    encoder.add_argument("--sasrec-preset", default="base", choices=("tiny", "base", "large"))
    encoder.add_argument("--sasrec-steps", type=int, default=1500)
    encoder.add_argument("--sasrec-batch", type=int, default=128)
    encoder.add_argument("--max-seq-len", type=int, default=50, help="SASRec history window")
    backbone = parser.add_argument_group("backbone")
    backbone.add_argument("--backbone", type=Path, default=None,
                          help="a local Hugging Face causal LM folder (skips pretraining)")  # fmt: skip
    backbone.add_argument("--save-backbone", type=Path, default=None,
                          help="save the pretrained small backbone here")  # fmt: skip
    backbone.add_argument("--item-init", default="auto", choices=("auto", "random", "sasrec"),
                          help="the small backbone's item tokens: from SASRec's item table "
                               "(seed_item_embeddings; auto: unless --backbone), or random")  # fmt: skip
    backbone.add_argument("--hidden-size", type=int, default=256)
    backbone.add_argument("--layers", type=int, default=4)
    backbone.add_argument("--heads", type=int, default=4)
    backbone.add_argument("--intermediate-size", type=int, default=688)
    backbone.add_argument("--pretrain-epochs", type=int, default=4)
    training = parser.add_argument_group("injector and training")
    training.add_argument("--num-soft-tokens", type=int, default=6)
    training.add_argument("--mlp-dim", type=int, default=None,
                          help="the injector's inner width (default: sized to LoRA's parameters)")  # fmt: skip
    training.add_argument("--soft-position", default="history", choices=("history", "bos"),
                          help="soft tokens after the history (default) or after the BOS")  # fmt: skip
    training.add_argument("--prompt-history", type=int, default=50, help="items in a prompt")
    training.add_argument("--cheap-history", type=int, default=10,
                          help="items in training histories of reprec_cheap")  # fmt: skip
    training.add_argument("--epochs", type=int, default=2)
    training.add_argument("--batch-size", type=int, default=128)
    training.add_argument("--lr", type=float, default=1e-3, help="the injector's learning rate")
    training.add_argument("--lora-lr", type=float, default=1e-3)
    training.add_argument("--train-users", type=int, default=None, help="subsample training users")
    training.add_argument("--train-negatives", default="uniform",
                          choices=("uniform", "popularity", "mixed"),
                          help="negatives of the REPREC and LoRA training examples (mixed: "
                               "half by popularity, as the evaluation draws them)")  # fmt: skip
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval-users", type=int, default=2000,
                            help="seeded sample of users to rank for (0: all)")  # fmt: skip
    evaluation.add_argument("--eval-negatives", type=int, default=200)
    evaluation.add_argument("--negatives", type=_csv(str, ("mixed", "uniform", "popularity")),
                            default=("mixed",),
                            help="mixed: half popularity, half uniform (default)")  # fmt: skip
    parser.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> RepRecConfig:
    import dataclasses

    import torch

    from loka.reprec.backbone import BackboneConfig, PretrainConfig
    from loka.reprec.pipeline import RepRecConfig
    from loka.reprec.train import TrainConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    train = TrainConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        max_users=args.train_users,
        negative_sampling=args.train_negatives,
        seed=args.seed,
    )
    return RepRecConfig(
        dataset=args.dataset,
        data_dir=args.data_dir,
        device=device,
        seed=args.seed,
        bf16=args.bf16,
        methods=tuple(args.methods),
        sasrec_preset=args.sasrec_preset,
        sasrec_steps=args.sasrec_steps,
        sasrec_batch=args.sasrec_batch,
        sasrec_max_seq_len=args.max_seq_len,
        backbone_path=str(args.backbone) if args.backbone else None,
        backbone=BackboneConfig(
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.heads,
            intermediate_size=args.intermediate_size,
        ),
        pretrain=PretrainConfig(epochs=args.pretrain_epochs, seed=args.seed),
        save_backbone_to=str(args.save_backbone) if args.save_backbone else None,
        item_init=args.item_init,
        prompt_history=args.prompt_history,
        num_soft_tokens=args.num_soft_tokens,
        soft_position=args.soft_position,
        injector_mlp_dim=args.mlp_dim,
        reprec=train,
        lora=dataclasses.replace(train, lr=args.lora_lr),
        cheap_history=args.cheap_history,
        eval_users=args.eval_users or None,
        eval_negatives=args.eval_negatives,
        eval_sampling=tuple(args.negatives),
    )


def progress_lines(
    write: Callable[[str], None], *, every: float = 15.0
) -> Callable[[str, int, int], None]:
    """A progress callback for output that is not a terminal: one line per phase at its
    start and end, and at most one every `every` seconds in between."""
    start = time.monotonic()
    last: dict[str, float] = {}

    def on_progress(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase not in last or done >= total or now - last[phase] >= every:
            last[phase] = now
            write(f"[{now - start:7.1f}s] {phase}: {done}/{total}")

    return on_progress


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from loka.reprec.pipeline import run_reprec

    console = Console(highlight=False)
    config = build_config(args)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    if not console.is_terminal:  # a log file or a pipe: a line now and then, not a live bar
        report = run_reprec(config, progress_lines(lambda line: print(line, flush=True)))
    else:
        with Progress(*columns, console=console) as progress:  # stopped before an error prints
            tasks: dict[str, int] = {}

            def on_progress(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = progress.add_task(phase, total=total)
                progress.update(tasks[phase], completed=done, total=total)

            report = run_reprec(config, on_progress)
    json_path, csv_path = report.write(args.out)
    if console.is_terminal:
        print_report(console, report)
    else:  # plain lines, never wrapped to a guessed width
        for line in report.summary_lines():
            print(line, flush=True)
    console.print(f"results written to {json_path} and {csv_path}")
    return 0


def print_report(console, report: RepRecReport) -> None:
    from rich.table import Table

    from loka.reprec.pipeline import CELL_HEADER, GROUPS

    for negatives in dict.fromkeys(row["negatives"] for row in report.rows):
        table = Table(title=f"test ranking vs {negatives} negatives", title_justify="left")
        table.add_column("method")
        for group in GROUPS:
            table.add_column(f"{group}: {CELL_HEADER} (users)", justify="right")
        for method, cells in report.cells(negatives).items():
            table.add_row(method, *(cells.get(g, "-") for g in GROUPS))
        console.print(table)
    for line in report.training_lines():
        console.print(line)
    for note in report.notes:
        console.print(f"[dim]{note}[/dim]")
