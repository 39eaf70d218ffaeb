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

    python bench/lordba_quality.py --quick       # 40 + 20 steps, 512 users
    python bench/lordba_quality.py               # 150 + 100 steps, 3,072 users (878 s on a loaded 2-core CPU)

Results: --out (default $OUT, else bench/results/)/lordba_quality_<mode>_<utc>.json (command,
versions, raw numbers; bench/harness.py's metadata).
Needs the Amazon 5-core data (``LOKA_DATA_DIR``, see loka.zoo.data.amazon).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

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


# ---- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "lora" or "lordba"
    rank: int
    bits: int | None = None


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
    args = parser.parse_args(argv)
    if args.pretrain_steps is None:
        args.pretrain_steps = 40 if args.quick else 150
    if args.adapt_steps is None:
        args.adapt_steps = 20 if args.quick else 100
    if args.eval_batches is None:
        args.eval_batches = 8 if args.quick else 48
    return args


def _train(setup, model, params, steps: int, lr: float, seed: int) -> list[float]:
    from loka.zoo.train import training_step

    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    batches = setup.train_batches()
    return [float(training_step(setup, model, optimizer, next(batches))) for _ in range(steps)]


def _evaluate(setup, model, held_out) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        found = setup.metrics(model, held_out)
    return {k: float(v) for k, v in found.items()}


def run(args: argparse.Namespace) -> dict:
    import copy

    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    import loka.zoo as zoo
    from loka.lordba import LoRDBAConfig, LoRDBALinear, lordba_footprint

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    setup = zoo.create(
        "sasrec", "base", dataset=args.dataset, max_seq_len=20, seed=args.seed,
        batch_size=args.batch_size,
    )  # fmt: skip
    held_out = setup.eval_batches(args.eval_batches or None, split="valid")
    n_users = sum(len(next(iter(b.values())) if isinstance(b, dict) else b[0]) for b in held_out)
    rows: list[dict] = []

    def log(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    pretrain_losses = _train(
        setup, setup.model, list(setup.model.parameters()), args.pretrain_steps, 3e-3, args.seed
    )
    base = setup.model.requires_grad_(False)
    log({"variant": "base fp32", **_evaluate(setup, base, held_out), "adapter_bytes": 0})
    quantize_(base, Int8WeightOnlyConfig())
    log({"variant": "base int8 (frozen)", **_evaluate(setup, base, held_out), "adapter_bytes": 0})

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
        losses = _train(setup, model, params, args.adapt_steps, args.lr, args.seed + 1)
        seconds = time.perf_counter() - t0
        row = {"variant": variant.name, **_evaluate(setup, model, held_out)}
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
    log({"variant": f"LoRDBA r={r} fitted from fp16 LoRA r={r} (no training)",
         **_evaluate(setup, fitted, held_out), "adapter_bytes": lordba_total,
         **{f"mean_{k}": v for k, v in mean.items()}})  # fmt: skip
    return {
        "rows": rows,
        "fit_per_module": ratios,
        "pretrain_loss_first_last10": [pretrain_losses[0], sum(pretrain_losses[-10:]) / 10],
        "eval_users": n_users,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    result = run(args)
    meta = metadata("cpu", threads=torch.get_num_threads(), args=vars(args))
    name = f"lordba_quality_{'quick' if args.quick else 'cpu'}_{stamp()}.json"
    path = write_json(Path(args.out) / name, {"meta": meta, "result": result})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
