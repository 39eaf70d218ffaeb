"""LoRDBA quality against fp16 LoRA and low-bit LoRA at matched adapter bytes (issue 19).

The task is real and runs on a CPU in minutes: next-item prediction on Amazon Beauty 5-core
with the zoo's SASRec (a small causal transformer over item ids; 8 linears of 64 features).

1. Pretrain SASRec (all parameters) for ``--pretrain-steps``: the base.
2. Freeze it and quantize its linears to int8 weight-only (torchao ``Int8WeightOnlyConfig``):
   the paper's setting, a frozen quantized base with an unmerged adapter.
3. On that base, train each adapter for ``--adapt-steps`` on the same batches (same seed),
   AdamW, every linear adapted, embeddings and norms frozen: fp16 LoRA at the reference rank
   and at the rank matching LoRDBA's bytes; LoRA with 1- and 2-bit factors (quantization-aware,
   per-row fp16 scale, straight-through); LoRDBA trained from scratch; LoRDBA fitted from the
   trained fp16 LoRA (no further training), with its residual-to-magnitude ratios.
4. Evaluate HR@10 / NDCG@10 on the validation split (100 sampled negatives, the zoo's
   protocol) for every variant, the fp32 and the int8 base; adapter bytes beside each.

``--shift half`` (or ``third``) makes the adaptation data differ from the base's: the base is
pretrained only on the older part of every user's training sequence (its first half or third,
at least 3 items), the adapters train on the full training sequences, so the newer
interactions are what they can learn and the base never saw. ``--seeds 0,1,2`` repeats the
whole run (pretrain and adapt) per seed on the same evaluation users and reports, per
variant, the mean over seeds and the paired difference to fp16 LoRA at the reference rank:
each user's hit difference averaged over the seeds, with a 95% confidence interval over
users (normal approximation).

    python bench/lordba_quality.py --quick       # 40 + 20 steps, 512 users
    python bench/lordba_quality.py               # 150 + 100 steps, 3,072 users (878 s on a loaded 2-core CPU)
    python bench/lordba_quality.py --shift half --seeds 0,1,2

Results: --out (default $OUT, else bench/results/)/lordba_quality_[shift_]<mode>_<utc>.json
(command, versions, raw numbers per seed, the summary; bench/harness.py's metadata).
Needs the Amazon 5-core data (``LOKA_DATA_DIR``, see loka.zoo.data.amazon).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from harness import metadata, parser, stamp, write_json
from torch import nn

# ---- pure parts: quantized LoRA factors and byte counts -------------------------------------


def quantize_rows(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """``weight`` quantized per row to ``bits`` bits, returned dequantized (float).

    1 bit: ``sign(w) * mean|w|`` per row (the L2-optimal scale for a fixed sign pattern).
    b >= 2 bits: 2^b symmetric levels at odd multiples of ``d / 2``, ``d = max|w| / 2^(b-1)``
    (no zero level, so every level is used and the grid spans the row's range).
    """
    if bits < 1:
        raise ValueError(f"bits must be >= 1, got {bits}")
    if bits == 1:
        scale = weight.abs().mean(dim=1, keepdim=True)
        return torch.where(weight < 0, -scale, scale)
    half = 2 ** (bits - 1)
    step = (weight.abs().amax(dim=1, keepdim=True) / half).clamp_min(1e-12)
    index = torch.floor(weight / step).clamp(-half, half - 1)
    return (index + 0.5) * step


def ste_quantize_rows(weight: torch.Tensor, bits: int | None) -> torch.Tensor:
    """Forward: :func:`quantize_rows`; backward: identity (straight-through)."""
    if bits is None:
        return weight
    return weight + (quantize_rows(weight, bits) - weight).detach()


def lora_bytes(in_features: int, out_features: int, rank: int, bits: int | None) -> int:
    """Shipped bytes of one LoRA pair: fp16 factors (``bits=None``), or ``bits``-bit factors
    with one fp16 scale per row of A (``rank``) and of B (``out_features``)."""
    elements = rank * (in_features + out_features)
    if bits is None:
        return 2 * elements
    return (
        math.ceil(rank * in_features * bits / 8)
        + math.ceil(out_features * rank * bits / 8)
        + 2 * (rank + out_features)
    )


def matched_rank(shapes: list[tuple[int, int]], budget: int, bits: int | None) -> int:
    """The rank whose LoRA (``bits``) over all ``shapes`` costs closest to ``budget`` bytes
    (at least 1)."""

    def cost(rank: int) -> int:
        return sum(lora_bytes(k, n, rank, bits) for k, n in shapes)

    best = min(range(1, 257), key=lambda rank: (abs(cost(rank) - budget), rank))
    return best


class LoRALinear(nn.Module):
    """``base(x) + s * (x Q(A)^T) Q(B)^T`` with ``Q`` the per-row quantizer of ``bits`` bits
    (None: the factors as they are, fp16 LoRA). peft's initialization: A Kaiming-uniform,
    B = 0. The base stays frozen and runs through its own forward (quantized or not)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, bits: int | None = None) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.bits, self.scaling = rank, bits, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank))

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return ste_quantize_rows(self.lora_a, self.bits), ste_quantize_rows(self.lora_b, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.factors()
        return self.base(x) + self.scaling * ((x @ a.t()) @ b.t())

    def shipped_bytes(self) -> int:
        return lora_bytes(self.in_features, self.out_features, self.rank, self.bits)


def wrap_linears(model: nn.Module, make) -> list[str]:
    """Replace every ``nn.Linear`` child of ``model`` by ``make(linear)``; the names wrapped."""
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))
    return names


def older_prefix(train_prefix: np.ndarray, divisor: int, minimum: int = 3) -> np.ndarray:
    """Per user, how many of the ``train_prefix`` oldest items the base may see: the first
    ``1 / divisor`` of them, at least ``minimum`` (never more than there are)."""
    return np.minimum(np.maximum(minimum, train_prefix // divisor), train_prefix)


def per_user_ranking(scores: torch.Tensor, k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``scores`` ``[N, C]`` (target in column 0): the expected hit@k and NDCG@k
    under uniform tie-breaking, as ``loka.zoo.metrics.ranking_metrics`` averages them."""
    scores = scores.detach().double()
    target, others = scores[:, :1], scores[:, 1:]
    beaten_by = (others > target).sum(1, keepdim=True)
    tied = (others == target).sum(1, keepdim=True)
    offset = torch.arange(scores.size(1), device=scores.device).view(1, -1)
    rank = (beaten_by + offset).double()
    weight = (offset <= tied).double() / (tied + 1).double()
    hit = (rank < k).double()
    return (weight * hit).sum(1), (weight * hit / torch.log2(rank + 2)).sum(1)


# Two-sided 95% Student t quantiles by degrees of freedom (beyond 10: the normal 1.96).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}  # fmt: skip


def paired_difference(values: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """``values`` and ``reference`` ``[seeds, users]`` per-user metrics of two variants on the
    same users. ``mean``, ``se``, ``ci95``: each user's difference averaged over seeds, a 95%
    normal interval over users (users independent; seeds share a user; the training noise
    between seeds is not in it). ``seed_se``, ``seed_ci95``: the per-seed mean differences
    treated as the samples (Student t, seeds - 1 degrees of freedom): the training noise is in
    it, but with few seeds it is wide."""
    per_user = (values - reference).double().mean(0)
    n = per_user.numel()
    mean = float(per_user.mean())
    se = float(per_user.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan")
    per_seed = (values - reference).double().mean(1)
    seeds = per_seed.numel()
    nan = float("nan")
    seed_se = float(per_seed.std(unbiased=True)) / math.sqrt(seeds) if seeds > 1 else nan
    t = _T95.get(seeds - 1, 1.96)
    return {
        "mean": mean,
        "se": se,
        "ci95": [mean - 1.96 * se, mean + 1.96 * se],
        "per_seed": per_seed.tolist(),
        "seed_se": seed_se,
        "seed_ci95": [mean - t * seed_se, mean + t * seed_se],
        "users": n,
    }


# ---- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "lora" or "lordba"
    rank: int
    bits: int | None = None


SHIFTS = {"none": 1, "half": 2, "third": 3}  # divisor of the base's share of each sequence


def _parser() -> argparse.ArgumentParser:
    return parser(__doc__)  # --out (default $OUT, else bench/results/) and --budget-s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    parser.add_argument("--quick", action="store_true", help="tiny budget: 40 + 20 steps")
    parser.add_argument("--dataset", default="beauty")
    parser.add_argument("--pretrain-steps", type=int, default=None)
    parser.add_argument("--adapt-steps", type=int, default=None)
    parser.add_argument("--eval-batches", type=int, default=None, help="0: all")
    parser.add_argument("--batch-size", type=int, default=64, help="training and eval batch")
    parser.add_argument("--rank", type=int, default=8, help="LoRDBA / reference LoRA rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", default=None, help="comma-separated seeds, each a full run (overrides --seed)"
    )
    parser.add_argument(
        "--shift",
        choices=SHIFTS,
        default="none",
        help="pretrain the base on the older half/third of each user's training sequence only",
    )
    args = parser.parse_args(argv)
    args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    if args.pretrain_steps is None:
        args.pretrain_steps = 40 if args.quick else 150
    if args.adapt_steps is None:
        args.adapt_steps = 20 if args.quick else 100
    if args.eval_batches is None:
        args.eval_batches = 8 if args.quick else 48
    return args


def _train(setup, model, params, steps: int, lr: float, seed: int, stream=None) -> list[float]:
    from loka.zoo.train import training_step

    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    batches = (stream or setup.data).train_batches()
    return [float(training_step(setup, model, optimizer, next(batches))) for _ in range(steps)]


def _evaluate(setup, model, held_out, per_user: dict, name: str) -> dict[str, float]:
    """The zoo's metrics of ``model`` on ``held_out``; per-user hit and NDCG kept in
    ``per_user[name]``."""
    from loka.zoo.metrics import ranking_metrics

    model.eval()
    with torch.no_grad():
        scores = torch.cat([model(batch).float() for batch in held_out])
    per_user[name] = per_user_ranking(scores)
    return {k: float(v) for k, v in ranking_metrics(scores, k=10).items()}


def older_part_stream(stream, divisor: int):
    """A copy of an ``AmazonStream`` whose training windows hold only the older part of each
    user's training sequence (``older_prefix``); evaluation is untouched."""
    import copy

    from loka.zoo.data import amazon

    data = stream.data
    users = np.arange(data.num_users)
    prefix = older_prefix(amazon.split_prefix(data, "train"), divisor)
    older = copy.copy(stream)
    older._windows = amazon.left_padded(data, users, prefix, stream.max_seq_len + 1)
    older._window_lengths = np.minimum(prefix, stream.max_seq_len + 1)
    return older, prefix


def _interval(d: dict) -> str:
    return (
        f"{d['mean']:+.4f} (95% CI over users {d['ci95'][0]:+.4f} .. {d['ci95'][1]:+.4f}; "
        f"over seeds {d['seed_ci95'][0]:+.4f} .. {d['seed_ci95'][1]:+.4f}; "
        f"per seed {', '.join(f'{x:+.4f}' for x in d['per_seed'])})"
    )


def run(args: argparse.Namespace) -> dict:
    seeds, per_user = [], []
    started = time.perf_counter()
    for seed in args.seeds:
        print(f"# seed {seed}", flush=True)
        result, hits = run_seed(args, seed)
        seeds.append(result)
        per_user.append(hits)
    names = [row["variant"] for row in seeds[0]["rows"]]
    reference = f"fp16 LoRA r={args.rank}"
    summary = []
    for name in names:
        found = [next(r for r in s["rows"] if r["variant"] == name) for s in seeds]
        hr = torch.stack([p[name][0] for p in per_user])
        ndcg = torch.stack([p[name][1] for p in per_user])
        row = {
            "variant": name,
            "hr@10_mean": sum(r["hr@10"] for r in found) / len(found),
            "ndcg@10_mean": sum(r["ndcg@10"] for r in found) / len(found),
            "hr@10_per_seed": [r["hr@10"] for r in found],
            "adapter_bytes": found[0]["adapter_bytes"],
        }
        if name != reference:
            ref_hr = torch.stack([p[reference][0] for p in per_user])
            ref_ndcg = torch.stack([p[reference][1] for p in per_user])
            row["hr@10_minus_reference"] = paired_difference(hr, ref_hr)
            row["ndcg@10_minus_reference"] = paired_difference(ndcg, ref_ndcg)
        summary.append(row)
    base_int8 = "base int8 (frozen)"
    gap = paired_difference(
        torch.stack([p[reference][0] for p in per_user]),
        torch.stack([p[base_int8][0] for p in per_user]),
    )
    print(f"# reference: {reference}; seeds {args.seeds}; shift {args.shift}", flush=True)
    print(f"# {reference} - {base_int8}: HR@10 {_interval(gap)}", flush=True)
    for row in summary:
        line = (
            f"# {row['variant']}: HR@10 {row['hr@10_mean']:.4f} NDCG@10 {row['ndcg@10_mean']:.4f}"
        )
        if "hr@10_minus_reference" in row:
            line += f"; minus reference {_interval(row['hr@10_minus_reference'])}"
        print(line, flush=True)
    return {
        "reference": reference,
        "reference_minus_base_int8_hr@10": gap,
        "summary": summary,
        "seeds": seeds,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def run_seed(args: argparse.Namespace, seed: int) -> tuple[dict, dict]:
    import copy

    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    import loka.zoo as zoo
    from loka.lordba import LoRDBAConfig, LoRDBALinear, lordba_footprint

    started = time.perf_counter()
    torch.manual_seed(seed)
    setup = zoo.create(
        "sasrec", "base", dataset=args.dataset, max_seq_len=20, seed=seed,
        batch_size=args.batch_size,
    )  # fmt: skip
    held_out = setup.eval_batches(args.eval_batches or None, split="valid")
    n_users = sum(len(next(iter(b.values())) if isinstance(b, dict) else b[0]) for b in held_out)
    rows: list[dict] = []
    per_user: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def log(row: dict) -> None:
        row = {"seed": seed, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)

    pretrain_stream, shift_info = setup.data, {}
    if SHIFTS[args.shift] > 1:
        pretrain_stream, prefix = older_part_stream(setup.data, SHIFTS[args.shift])
        full = setup.data._window_lengths
        older = pretrain_stream._window_lengths
        shift_info = {
            "divisor": SHIFTS[args.shift],
            "base_window_items_share": float(older.sum() / full.sum()),
            "users_truncated": float((older < full).mean()),
            "mean_older_prefix": float(prefix.mean()),
        }
    pretrain_losses = _train(
        setup, setup.model, list(setup.model.parameters()), args.pretrain_steps, 3e-3, seed,
        pretrain_stream,
    )  # fmt: skip
    base = setup.model.requires_grad_(False)
    log({"variant": "base fp32", **_evaluate(setup, base, held_out, per_user, "base fp32"),
         "adapter_bytes": 0})  # fmt: skip
    quantize_(base, Int8WeightOnlyConfig())
    name = "base int8 (frozen)"
    log({"variant": name, **_evaluate(setup, base, held_out, per_user, name), "adapter_bytes": 0})

    shapes = [(m.in_features, m.out_features) for m in base.modules() if type(m) is nn.Linear]
    r = args.rank
    lordba_total = sum(lordba_footprint(k, n, r).lordba_bytes for k, n in shapes)
    variants = [
        Variant(f"fp16 LoRA r={r}", "lora", r),
        Variant(
            f"fp16 LoRA r={matched_rank(shapes, lordba_total, None)} (bytes matched)",
            "lora",
            matched_rank(shapes, lordba_total, None),
        ),
        Variant(
            f"1-bit LoRA r={matched_rank(shapes, lordba_total, 1)}",
            "lora",
            matched_rank(shapes, lordba_total, 1),
            bits=1,
        ),
        Variant(
            f"2-bit LoRA r={matched_rank(shapes, lordba_total, 2)}",
            "lora",
            matched_rank(shapes, lordba_total, 2),
            bits=2,
        ),
        Variant(f"LoRDBA r={r}", "lordba", r),
    ]
    trained_lora = None
    for variant in variants:
        model = copy.deepcopy(base)
        if variant.kind == "lora":
            wrap_linears(model, lambda m, v=variant: LoRALinear(m, v.rank, 2.0 * v.rank, v.bits))
            size = sum(m.shipped_bytes() for m in model.modules() if isinstance(m, LoRALinear))
        else:
            config = LoRDBAConfig(rank=variant.rank, backend="torch")
            wrap_linears(model, lambda m, c=config: LoRDBALinear(m, c))
            size = lordba_total
        params = [p for p in model.parameters() if p.requires_grad]
        t0 = time.perf_counter()
        losses = _train(setup, model, params, args.adapt_steps, args.lr, seed + 1)
        seconds = time.perf_counter() - t0
        row = {"variant": variant.name, **_evaluate(setup, model, held_out, per_user, variant.name)}
        row |= {"adapter_bytes": size, "train_s": round(seconds, 2)}
        row |= {"loss_first": losses[0], "loss_last10": sum(losses[-10:]) / len(losses[-10:])}
        log(row)
        if variant.kind == "lora" and variant.rank == r and variant.bits is None:
            trained_lora = model

    # LoRDBA fitted from the trained fp16 LoRA: signs and rank-one magnitudes, no training.
    fitted = copy.deepcopy(trained_lora)
    ratios = []
    for name, module in list(fitted.named_modules()):
        if isinstance(module, LoRALinear):
            adapter, fit = LoRDBALinear.from_lora(
                module.base, module.lora_a.detach(), module.lora_b.detach(), module.scaling,
                LoRDBAConfig(rank=module.rank, backend="torch"),
            )  # fmt: skip
            parent_name, _, child = name.rpartition(".")
            setattr(fitted.get_submodule(parent_name), child, adapter)
            ratios.append(
                {
                    "module": name,
                    "rho_a": fit.residual_ratio_a,
                    "rho_b": fit.residual_ratio_b,
                    "update_error": fit.reconstruction_error,
                }
            )
    mean = {k: sum(x[k] for x in ratios) / len(ratios) for k in ("rho_a", "rho_b", "update_error")}
    name = f"LoRDBA r={r} fitted from fp16 LoRA r={r} (no training)"
    log({"variant": name, **_evaluate(setup, fitted, held_out, per_user, name),
         "adapter_bytes": lordba_total, **{f"mean_{k}": v for k, v in mean.items()}})  # fmt: skip
    tail = pretrain_losses[-10:]
    result = {
        "seed": seed,
        "rows": rows,
        "fit_per_module": ratios,
        "pretrain_loss_first_last10": [pretrain_losses[0], sum(tail) / len(tail)],
        "shift": shift_info,
        "eval_users": n_users,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return result, per_user


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    result = run(args)
    meta = metadata("cpu", threads=torch.get_num_threads(), args=vars(args))
    shift = "" if args.shift == "none" else "shift_"
    name = f"lordba_quality_{shift}{'quick' if args.quick else 'cpu'}_{stamp()}.json"
    path = write_json(Path(args.out) / name, {"meta": meta, "result": result})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
