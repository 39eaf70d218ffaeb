"""The REPREC pipeline end to end, and its baselines on the same data and prompts:

1. SASRec trained by `loka.zoo` on the training split (the frozen user encoder, and the
   "sasrec" baseline: its own dot-product scores);
2. the backbone: a local Hugging Face causal LM, or the small Llama pretrained on the
   training histories as text;
3. "zero_shot": the frozen backbone's log p(" Yes") on the plain prompt;
4. "reprec": the injector trained on soft tokens in front of the frozen backbone;
5. "lora": peft LoRA (q/v projections) trained on the same prompts without soft tokens;
6. "reprec_cheap": the injector trained on short histories, evaluated on long ones;

each ranked against the same seeded negatives (uniform and popularity), per activity group.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import loka.zoo as zoo
from loka.reprec.backbone import (
    ITEM_INITS,
    BackboneConfig,
    PretrainConfig,
    build_backbone,
    load_backbone,
    pretrain_backbone,
    save_backbone,
    seed_item_embeddings,
)
from loka.reprec.data import load_dataset, sasrec_setup
from loka.reprec.evaluate import grouped_metrics, score_eval_set
from loka.reprec.examples import ACTIVITY_GROUPS, EVAL_SAMPLING, eval_set, sample_users
from loka.reprec.injector import (
    InjectorConfig,
    UserEmbeddingInjector,
    injector_width_for,
    parameter_share,
)
from loka.reprec.lora import lora_parameter_count, with_lora
from loka.reprec.model import SOFT_POSITIONS, PromptScorer, context_sensitivity
from loka.reprec.prompts import PromptEncoder
from loka.reprec.tokenizer import build_item_tokenizer
from loka.reprec.train import TrainConfig, train_scorer

METHODS = ("sasrec", "zero_shot", "reprec", "lora", "reprec_cheap")
GROUPS = ("all", *ACTIVITY_GROUPS)
CELL_METRICS = ("hr@5", "ndcg@5", "hr@10", "ndcg@10")
CELL_HEADER = "HR@5/NDCG@5/HR@10/NDCG@10"
Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class RepRecConfig:
    """Everything one run needs. `backbone_path` takes any local Hugging Face causal LM
    folder (it brings its tokenizer); without it the small Llama of `backbone` is built and
    pretrained (`pretrain`), and saved to `save_backbone_to` when given."""

    dataset: str = "beauty"  # a 5-core file, or a name found in data_dir (loka.reprec.data)
    data_dir: str | None = None
    device: str = "cpu"
    seed: int = 0
    bf16: bool = False  # bfloat16 autocast for every forward and backward
    methods: tuple[str, ...] = METHODS
    # The user encoder: SASRec trained by loka.zoo on the training split.
    sasrec_preset: str = "base"
    sasrec_steps: int = 1500
    sasrec_lr: float = 3e-3
    sasrec_batch: int = 128
    sasrec_max_seq_len: int = 50
    # The backbone.
    backbone_path: str | None = None
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    save_backbone_to: str | None = None
    # The small backbone's item tokens: "sasrec" (the trained SASRec's item table through
    # `seed_item_embeddings`, before pretraining; on Beauty zero-shot HR@5 0.040 -> 0.162),
    # or "random"; "auto" is "sasrec" unless `backbone_path` loads a model with its own.
    item_init: str = "auto"
    # Prompts, injector, training.
    prompt_history: int = 50
    num_soft_tokens: int = 6
    soft_position: str = "history"
    # None: sized so that the injector's parameters match LoRA's (lora_parameter_count).
    injector_mlp_dim: int | None = None
    injector_dropout: float = 0.1
    reprec: TrainConfig = field(default_factory=lambda: TrainConfig(lr=3e-3))
    lora: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-3))
    lora_rank: int = 8
    lora_alpha: int = 16
    cheap_history: int = 10
    # Evaluation.
    eval_split: str = "test"
    eval_users: int | None = 2000
    eval_negatives: int = 200
    eval_sampling: tuple[str, ...] = ("mixed",)
    eval_max_prompts: int = 4096

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown or not self.methods:
            raise ValueError(
                f"methods must be a non-empty subset of {list(METHODS)}, got {unknown}"
            )
        for name in ("prompt_history", "num_soft_tokens", "cheap_history", "sasrec_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for sampling in self.eval_sampling:
            if sampling not in EVAL_SAMPLING:
                raise ValueError(f"eval_sampling holds {EVAL_SAMPLING}, got {sampling!r}")
        if self.soft_position not in SOFT_POSITIONS:
            raise ValueError(f"soft_position must be one of {SOFT_POSITIONS}")
        if self.item_init not in ITEM_INITS:
            raise ValueError(f"item_init must be one of {ITEM_INITS}, got {self.item_init!r}")
        if self.item_init not in ("auto", "random") and self.backbone_path is not None:
            raise ValueError(
                f"item_init={self.item_init!r} seeds the small backbone's item tokens; a "
                "loaded backbone (backbone_path) keeps its own embeddings"
            )
        if self.injector_mlp_dim is not None and self.injector_mlp_dim < 1:
            raise ValueError(f"injector_mlp_dim must be positive, got {self.injector_mlp_dim}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RepRecReport:
    """`rows`: one per method x negatives x activity group, with `users`, `hr@5`,
    `ndcg@5`, `hr@10`, `ndcg@10`, `mrr`; `training`: per trained method, the epochs' wall times and losses;
    `parameters`: counts; `seconds`: wall time per phase."""

    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    training: dict[str, dict[str, Any]] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def epoch_time_ratio(self) -> float | None:
        """LoRA's median training time per epoch over REPREC's (> 1: REPREC is faster)."""
        lora, reprec = self.training.get("lora"), self.training.get("reprec")
        if not lora or not reprec:
            return None
        return lora["epoch_s_median"] / reprec["epoch_s_median"]

    def cells(self, negatives: str) -> dict[str, dict[str, str]]:
        """`{method: {group: "HR@5/NDCG@5/HR@10/NDCG@10 (users)"}}` for one kind of negatives."""
        table: dict[str, dict[str, str]] = {}
        for r in self.rows:
            if r["negatives"] == negatives:
                text = "/".join(f"{r[m]:.3f}" for m in CELL_METRICS) + f" ({int(r['users'])})"
                table.setdefault(r["method"], {})[r["group"]] = text
        return table

    def training_lines(self) -> list[str]:
        """Training time per epoch, parameters and losses of the trained methods."""
        lines = []
        for method, log in self.training.items():
            if "epoch_s" in log:
                lines.append(
                    f"{method}: {log['epoch_s_median']:.2f} s/epoch ({log['examples_per_epoch']} "
                    f"prompts), {log['trainable_parameters']:,} trainable parameters, loss "
                    f"{log['first_loss']:.3f} -> {log['final_loss']:.3f}"
                )
        ratio = self.epoch_time_ratio()
        if ratio is not None:
            lines.append(f"training time per epoch, LoRA / REPREC: {ratio:.2f}x")
        share = self.parameters.get("reprec_share")
        if share is not None:
            lines.append(
                f"injector: {self.parameters['reprec_injector']:,} parameters, LoRA: "
                f"{self.parameters['lora_budget']:,} ({self.parameters['injector_over_lora']:.2f}x"
                f"), injector {100 * share:.2f}% of injector + LLM ({self.parameters['llm']:,})"
            )
        return lines

    def summary_lines(self) -> list[str]:
        """The whole report as plain text: one table per kind of negatives, then training."""
        lines = []
        for negatives in dict.fromkeys(r["negatives"] for r in self.rows):
            lines.append(f"test, {negatives} negatives: {CELL_HEADER} (users)")
            lines.append(f"{'method':<14}" + "".join(f"{g:>32}" for g in GROUPS))
            for method, cells in self.cells(negatives).items():
                lines.append(f"{method:<14}" + "".join(f"{cells.get(g, '-'):>32}" for g in GROUPS))
        lines += self.training_lines()
        lines.append("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items()))
        return lines + self.notes

    def csv_text(self) -> str:
        if not self.rows:
            return ""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(self.rows[0]))
        writer.writeheader()
        writer.writerows(self.rows)
        return buffer.getvalue()

    def write(self, folder: str | Path, stem: str = "reprec") -> tuple[Path, Path]:
        """`<stem>.json` (everything) and `<stem>.csv` (the rows), each written atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        payload = dict(self.to_dict(), lora_over_reprec_epoch_time=self.epoch_time_ratio())
        paths = (folder / f"{stem}.json", folder / f"{stem}.csv")
        write_atomic(paths[0], json.dumps(payload, indent=1, default=str) + "\n")
        write_atomic(paths[1], self.csv_text())
        return paths


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _count(module: nn.Module, trainable: bool | None = None) -> int:
    return sum(
        p.numel() for p in module.parameters() if trainable is None or p.requires_grad == trainable
    )


def _training_summary(log: Any) -> dict[str, Any]:
    # The first epoch carries one-time costs (allocator, kernel selection): with more
    # than one epoch it is left out of the steady-state time.
    steady = sorted(log.epoch_seconds[1:] or log.epoch_seconds)
    return {
        "epoch_s": log.epoch_seconds,
        "epoch_s_median": steady[len(steady) // 2],
        "examples_per_epoch": log.examples_per_epoch,
        "trainable_parameters": log.trainable_parameters,
        "first_loss": log.losses[0],
        "final_loss": sum(log.losses[-20:]) / len(log.losses[-20:]),
    }


def run_reprec(config: RepRecConfig, on_progress: Progress | None = None) -> RepRecReport:
    """Run every method of `config.methods` and return the report (nothing is written)."""
    progress = on_progress or (lambda phase, done, total: None)
    device = torch.device(config.device)
    autocast = torch.bfloat16 if config.bf16 else None
    report = RepRecReport(config.to_dict())
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        report.seconds[phase] = report.seconds.get(phase, 0.0) + now - clock
        clock = now

    # 1. The user encoder.
    data = load_dataset(config.dataset, config.data_dir)
    report.notes.append(
        f"data: {data.path} ({data.num_users:,} users, {data.num_items:,} items, "
        f"{len(data.values):,} interactions)"
    )
    setup = sasrec_setup(
        data,
        config.sasrec_preset,
        device=device,
        seed=config.seed,
        batch_size=config.sasrec_batch,
        max_seq_len=config.sasrec_max_seq_len,
    )
    zoo.train(
        setup,
        config.sasrec_steps,
        lr=config.sasrec_lr,
        autocast_dtype=autocast,
        on_step=lambda step, loss: progress("sasrec", step + 1, config.sasrec_steps),
    )
    sasrec = setup.model.eval().requires_grad_(False)
    width = config.sasrec_max_seq_len
    report.parameters["sasrec"] = _count(sasrec)
    lap("sasrec_train")

    # 2. The backbone.
    if config.backbone_path is not None:
        llm, tokenizer = load_backbone(config.backbone_path, device=device)
        report.notes.append(f"backbone loaded from {config.backbone_path}")
    else:
        tokenizer = build_item_tokenizer(data.num_items)
        llm = build_backbone(config.backbone, tokenizer, seed=config.seed).to(device)
    prompts = PromptEncoder(tokenizer, data.num_items, history_items=config.prompt_history)
    if config.item_init != "random" and config.backbone_path is None:  # sasrec or auto
        items = torch.arange(data.num_items + 1, device=device)
        seeded = seed_item_embeddings(llm, prompts, sasrec.item_vectors(items), seed=config.seed)
        report.notes.append(
            f"item tokens: {seeded:,} rows seeded from SASRec's item table (item_init={config.item_init!r})"
        )
    if config.backbone_path is None:
        answers: list[float] = []
        losses = pretrain_backbone(
            llm,
            prompts,
            data,
            config.pretrain,
            autocast_dtype=autocast,
            on_step=lambda step, total, loss: progress("pretrain", step, total),
            answer_losses=answers,
        )
        report.training["pretrain"] = {
            "steps": len(losses),
            "first_loss": losses[0],
            "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        }
        if answers:  # ln 2 = 0.693: the answers no better than their prior
            report.training["pretrain"]["final_answer_loss"] = sum(answers[-20:]) / len(
                answers[-20:]
            )
        report.notes.append(
            "backbone: a small Llama built here and pretrained on the training split's "
            "histories as text (no pretrained LLM offline)"
        )
        if config.save_backbone_to is not None:
            save_backbone(llm, tokenizer, config.save_backbone_to)
    llm.eval().requires_grad_(False)
    report.parameters["llm"] = _count(llm)
    lap("backbone")

    # 3. The evaluation sets: the same users and negatives for every method.
    users = sample_users(data, config.eval_users, seed=config.seed)
    sets = {
        sampling: eval_set(
            data,
            width=width,
            split=config.eval_split,
            users=users,
            num_negatives=config.eval_negatives,
            negative_sampling=sampling,  # type: ignore[arg-type]
            seed=config.seed,
        )
        for sampling in config.eval_sampling
    }
    if config.eval_users is not None and config.eval_users < data.num_users:
        report.notes.append(f"evaluated on {len(users)} of {data.num_users} users (seeded sample)")

    def evaluate(method: str, scorer: Callable[..., torch.Tensor]) -> None:
        for sampling, chosen in sets.items():
            scores = score_eval_set(
                scorer,
                chosen,
                device=device,
                max_prompts=config.eval_max_prompts,
                autocast_dtype=autocast,
                on_batch=lambda done, total, phase=f"eval {method} ({sampling})": progress(
                    phase, done, total
                ),
            )
            for group, metrics in grouped_metrics(scores, chosen.activity).items():
                report.rows.append(
                    {"method": method, "negatives": sampling, "group": group, **metrics}
                )
        lap(f"{method}_eval")

    def train(method: str, scorer: PromptScorer, train_config: TrainConfig) -> None:
        log = train_scorer(
            scorer,
            data,
            train_config,
            width=width,
            autocast_dtype=autocast,
            on_step=lambda step, total, loss: progress(f"train {method}", step, total),
        )
        report.training[method] = _training_summary(log)
        lap(f"{method}_train")

    lora_budget = lora_parameter_count(llm, rank=config.lora_rank)
    report.parameters["lora_budget"] = lora_budget

    def injector() -> nn.Module:
        scale = llm.get_input_embeddings().weight.float().pow(2).mean().sqrt().item()
        user_dim = sasrec.config.embedding_dim
        hidden = llm.get_input_embeddings().weight.shape[1]
        mlp_dim = config.injector_mlp_dim or injector_width_for(
            lora_budget, user_dim=user_dim, hidden_size=hidden, num_tokens=config.num_soft_tokens
        )
        injector_config = InjectorConfig(
            user_dim=user_dim,
            hidden_size=hidden,
            num_tokens=config.num_soft_tokens,
            mlp_dim=mlp_dim,
            dropout=config.injector_dropout,
            output_scale=scale,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            return UserEmbeddingInjector(injector_config).to(device)

    for method in config.methods:
        if method == "sasrec":
            evaluate(method, lambda h, c: sasrec({"items": h, "candidates": c}))
        elif method == "zero_shot":
            evaluate(method, PromptScorer(llm, prompts))
        elif method in ("reprec", "reprec_cheap"):
            module = injector()
            scorer = PromptScorer(
                llm,
                prompts,
                injector=module,
                user_encoder=sasrec,
                soft_position=config.soft_position,  # type: ignore[arg-type]
            )
            train_config = config.reprec
            if method == "reprec_cheap":
                train_config = dataclasses.replace(train_config, history_items=config.cheap_history)
            report.parameters[f"{method}_injector"] = _count(module)
            report.parameters[f"{method}_share"] = parameter_share(module, llm)
            report.parameters["injector_over_lora"] = _count(module) / lora_budget
            sensitivity = context_sensitivity(scorer, sets[next(iter(sets))])
            report.parameters["soft_token_sensitivity"] = sensitivity
            if sensitivity < 0.01 and not any("barely reads" in n for n in report.notes):
                report.notes.append(
                    f"the frozen backbone's answer barely reads the soft tokens (random soft "
                    f"tokens move log p(Yes) by {sensitivity:.4f} on average): the injector "
                    "cannot learn through it; use a stronger backbone or pretrain it longer"
                )
            train(method, scorer, train_config)
            evaluate(method, scorer)
        elif method == "lora":
            adapted = with_lora(
                llm, rank=config.lora_rank, alpha=config.lora_alpha, seed=config.seed
            ).to(device)
            report.parameters["lora"] = _count(adapted, trainable=True)
            scorer = PromptScorer(adapted, prompts)
            train(method, scorer, config.lora)
            evaluate(method, scorer)
            del adapted, scorer
    return report
