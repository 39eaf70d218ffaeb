"""REPREC on Amazon Beauty: a frozen LLM conditioned by SASRec's user embedding through a
trained injector, against LoRA (r=8, q/v) on the same prompts, SASRec's own scores, the
zero-shot LLM, and REPREC trained on short histories ("cheap"), in one run.

Reported, as the original REPREC repository evaluates: HR@5, NDCG@5, HR@10, NDCG@10 (and
MRR) on the test split, the held-out item against 200 seeded negatives (100 by popularity +
100 uniform), prompts of the 50 latest items, overall and per activity group (cold 1-5,
medium 6-20, warm 21+ interactions); the injector sized to LoRA's parameter count (both
reported), the training time of every epoch of REPREC and LoRA, and how much the frozen
backbone's answer moves with the soft tokens (`soft_token_sensitivity`).

No pretrained LLM is available offline, so the backbone is a small Llama built here and
pretrained on the training split's histories as text (with membership questions, see
loka.reprec.backbone); give --backbone for a local Hugging Face checkpoint instead.

    python bench/reprec.py --smoke   # CPU, a generated tiny dataset, < 1 min: proves it runs
    python bench/reprec.py --cpu     # CPU, Beauty at reduced scale (~15 min on 2 cores)
    python bench/reprec.py           # one H200, full Beauty, about 4 min (Sports about 5)
Results in --out (default $OUT, else bench/results/): reprec_<mode>_<utc>.json (metadata,
configuration, every row, training times, parameter counts, phase times) and
reprec_<mode>_<utc>.csv (one row per method x negatives x activity group). The Amazon data
comes from --data-dir, else $LOKA_DATA_DIR, else <repository>/../shared/data/amazon-5core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

from harness import Budget, default_out, metadata, version, write_json
from harness import stamp as utc_stamp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny generated data, CPU, < 1 min")
    mode.add_argument("--cpu", action="store_true", help="Beauty at reduced scale on the CPU")
    p.add_argument("--out", default=default_out())
    p.add_argument("--data", default=None,
                   help="a 5-core file, or a name found in --data-dir (default beauty)")  # fmt: skip
    p.add_argument("--data-dir", default=None, help="folder holding the 5-core files")
    p.add_argument("--backbone", default=None, help="a local Hugging Face causal LM folder")
    p.add_argument("--save-backbone", default=None, help="save the pretrained backbone here")
    p.add_argument(
        "--item-init",
        default="auto",
        choices=("auto", "random", "sasrec"),
        help="the small backbone's item tokens (RepRecConfig.item_init)",
    )
    p.add_argument(
        "--train-negatives",
        default=None,
        choices=("uniform", "popularity", "mixed"),
        help="negatives of the REPREC and LoRA training examples (TrainConfig)",
    )
    p.add_argument("--eval-users", type=int, default=None, help="users ranked (0: all)")
    p.add_argument("--epochs", type=int, default=None, help="REPREC and LoRA epochs")
    p.add_argument("--pretrain-epochs", type=int, default=None)
    p.add_argument("--sasrec-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def mode_of(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "cpu" if args.cpu else "gpu"


# Set by main() from the command line; importing the script runs nothing.
ARGS = parse_args([])
MODE = mode_of(ARGS)
# This folder holds kernels.py, which would shadow the `kernels` package that transformers
# probes for: import packages from the environment only.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402

from loka.reprec import (  # noqa: E402
    BackboneConfig,
    PretrainConfig,
    RepRecConfig,
    TrainConfig,
    run_reprec,
)

BUDGET = Budget(None)  # counts the run's wall time from main()


def smoke_data(folder: Path) -> Path:
    """A generated 5-core-like dataset (Beauty.txt format): 60 users, 80 items, each user
    following one of four item clusters, so SASRec has something to learn."""
    import numpy as np

    rng = np.random.default_rng(0)
    lines = []
    for user in range(60):
        cluster = 1 + 20 * (user % 4) + np.arange(20)
        length = (5, 12, 26)[user % 3]
        lines.append(" ".join(map(str, [user + 1, *rng.choice(cluster, length)])))
    (folder / "Beauty.txt").write_text("\n".join(lines) + "\n")
    return folder


def config(data_dir: str | None) -> RepRecConfig:
    if MODE == "smoke":
        train = TrainConfig(epochs=1, batch_size=16, seed=ARGS.seed)
        base = RepRecConfig(
            data_dir=data_dir,
            sasrec_preset="tiny",
            sasrec_steps=30,
            sasrec_batch=16,
            sasrec_max_seq_len=16,
            backbone=BackboneConfig(
                hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
            ),
            pretrain=PretrainConfig(epochs=2, batch_size=8, block=64),
            reprec=train,
            lora=train,
            eval_users=40,
            eval_negatives=50,
            eval_sampling=("mixed", "uniform"),
        )
    elif MODE == "cpu":
        # Reduced for a shared 2-core machine: a narrow 2-layer backbone, 6 pretraining
        # epochs, 2 training epochs, 500 evaluated users.
        train = TrainConfig(epochs=2, batch_size=64, lr=3e-3, seed=ARGS.seed)
        base = RepRecConfig(
            data_dir=data_dir,
            sasrec_steps=600,
            sasrec_max_seq_len=20,
            backbone=BackboneConfig(
                hidden_size=64, num_layers=2, num_heads=2, intermediate_size=172
            ),
            pretrain=PretrainConfig(epochs=6, batch_size=32, block=128),
            reprec=train,
            lora=dataclasses.replace(train, lr=1e-3),
            eval_users=500,
            eval_max_prompts=2048,
        )
    else:
        train = TrainConfig(epochs=2, batch_size=256, lr=3e-3, seed=ARGS.seed)
        base = RepRecConfig(
            data_dir=data_dir,
            device="cuda",
            bf16=True,
            sasrec_steps=2500,
            sasrec_max_seq_len=50,
            backbone=BackboneConfig(
                hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688
            ),
            # 12 epochs: with the item tokens from SASRec, Beauty's answer loss reached 0.10
            # (20 epochs from random tokens: 0.18); 20 ran past a 290 s call on a slow host.
            pretrain=PretrainConfig(epochs=12, batch_size=64, block=128),
            reprec=train,
            lora=dataclasses.replace(train, lr=1e-3),
            eval_users=5000,
            eval_max_prompts=8192,
        )
    overrides = {
        "seed": ARGS.seed,
        "backbone_path": ARGS.backbone,
        "save_backbone_to": ARGS.save_backbone,
        "item_init": ARGS.item_init,
    }
    if ARGS.data is not None:
        overrides["dataset"] = ARGS.data
    if ARGS.eval_users is not None:
        overrides["eval_users"] = ARGS.eval_users or None
    if ARGS.sasrec_steps is not None:
        overrides["sasrec_steps"] = ARGS.sasrec_steps
    if ARGS.pretrain_epochs is not None:
        overrides["pretrain"] = dataclasses.replace(base.pretrain, epochs=ARGS.pretrain_epochs)
    train_overrides = {
        k: v
        for k, v in (("epochs", ARGS.epochs), ("negative_sampling", ARGS.train_negatives))
        if v is not None
    }
    if train_overrides:
        overrides["reprec"] = dataclasses.replace(base.reprec, **train_overrides)
        overrides["lora"] = dataclasses.replace(base.lora, **train_overrides)
    return dataclasses.replace(base, **overrides)


def label(run_config: RepRecConfig) -> str:
    b, users = run_config.backbone, run_config.eval_users or "all"
    scale = (
        f"backbone {b.hidden_size} wide x {b.num_layers} layers, "
        f"{run_config.pretrain.epochs} pretraining epochs, item tokens {run_config.item_init}, "
        f"{run_config.reprec.epochs} training epochs over "
        f"{run_config.reprec.max_users or 'all'} users, {users} evaluated users"
    )
    if run_config.backbone_path:
        scale = f"backbone {run_config.backbone_path}, " + scale.split(", ", 2)[2]
    return {
        "smoke": "CPU smoke run on a generated tiny dataset: proves the pipeline runs, the "
        "numbers mean nothing",
        "cpu": f"CPU, REDUCED scale ({scale}): a real but small-scale result",
        "gpu": f"GPU, {run_config.dataset} ({scale})",
    }[MODE]


def run_metadata(run_config: RepRecConfig) -> dict:
    cuda = torch.cuda.is_available() and MODE == "gpu"
    device = None if cuda else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    meta = metadata("cuda" if cuda else "cpu", mode=MODE, label=label(run_config),
                    transformers=version("transformers"), peft=version("peft"),
                    wall_s=BUDGET.elapsed())  # fmt: skip
    return meta | ({"device": device} if device else {})


def main(argv: list[str] | None = None) -> int:
    global ARGS, MODE, BUDGET
    ARGS = parse_args(argv)
    MODE, BUDGET = mode_of(ARGS), Budget(None)
    if MODE == "gpu" and not torch.cuda.is_available():
        raise SystemExit("bench/reprec.py needs a CUDA GPU; use --cpu (reduced) or --smoke")
    last: dict[str, float] = {}

    def progress(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last.get(phase, 0.0) > 15:
            last[phase] = now
            print(f"[{BUDGET.elapsed():7.1f}s] {phase}: {done}/{total}", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        data_dir = str(smoke_data(Path(scratch))) if MODE == "smoke" else ARGS.data_dir
        run_config = config(data_dir)
        report = run_reprec(run_config, progress)
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    data_name = (
        "" if MODE == "smoke" else "_" + re.sub(r"[^A-Za-z0-9]+", "", Path(run_config.dataset).stem)
    )
    stem = f"reprec_{MODE}{data_name}_{utc_stamp()}"
    report.notes.insert(0, label(run_config))
    json_path, csv_path = report.write(out, stem)
    payload = json.loads(json_path.read_text())
    payload["meta"] = run_metadata(run_config)
    write_json(json_path, payload)
    print("\n".join(["", f"REPREC bench ({payload['meta']['label']})", *report.summary_lines()]))
    print(f"written: {json_path} and {csv_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
