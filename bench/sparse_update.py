"""Row-wise Adagrad's sparse update at a zoo preset's table sizes: coalescing the table's
sparse gradient first (the first version) against sorting the lookups and summing duplicates
in the update's kernels (the default now, no `coalesce()`, no host sync).

The gradient is the real one: the preset's `FeatureEmbeddings` (one concatenated table,
`nn.EmbeddingBag(sparse=True)`) looks up a batch of the preset's synthetic data and takes a
random output gradient, so duplicate lookups are as skewed as in training (Wukong xl,
B=16384: ~530k lookups of ~47k distinct rows, the hottest row ~20k times). Each method is a
`RowWiseAdagrad.step()` on the same gradient:
- coalesce:   `grad.coalesce()` (sort + coalesceValuesKernel), then one Triton program per row;
- sort:       the default: sort the lookups, segment-sum them in chunks and update each row in
              two Triton kernels (CUDA); on the CPU the pure-torch path below;
- sort-torch: `torch.unique(return_inverse)` + `index_add_` + the torch update (CUDA only);
- sort[...]:  the sort path with other tuning constants (`--variants`; CUDA only).
The fused option (the update inside the lookup's backward) is timed with the lookups.
Each is checked against coalesce on the rows the batch touched (weights and accumulators from
the same start) before it is timed: the median device time of a step (do_bench on CUDA) and
its host time (the call returning, no sync: a step that syncs waits for the GPU there). The
lookup's forward + backward is timed beside them, with the model's padding index and without
one: the sparse backward's mask over padding lookups syncs with the host, the likely cause of
the 28-35 ms host time in `aten::_embedding_bag_sparse_backward` of the Wukong xl profile.

    python bench/sparse_update.py --smoke   # CPU, the tiny preset's tables, seconds
    python bench/sparse_update.py           # one H200: Wukong xl (18.8M rows x 128), ~1 min
Results in --out (default $OUT, else bench/results/): sparse_update_<mode>_<utc>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import Budget, metadata, parser, stamp, time_ms, write_json

METHODS = ("coalesce", "sort", "sort-torch")
# The sort path's tuning constants in loka.zoo.rowwise_adagrad that --variants may set.
TUNABLE = ("CHUNK", "HEADS", "UPDATE_ROWS")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="the tiny preset's tables, on the CPU")
    p.add_argument("--model", default="wukong", help="a zoo model with Criteo-like tables")
    p.add_argument("--preset", default=None, help="zoo preset (xl; smoke: tiny)")
    p.add_argument("--batch-size", type=int, default=None, help="lookups of (the preset's)")
    p.add_argument("--device", default=None, help="cuda when there is one, else cpu")
    p.add_argument("--reps", type=int, default=5, help="host-time repetitions per method")
    p.add_argument("--variants", default="UPDATE_ROWS=4;UPDATE_ROWS=16;CHUNK=64;HEADS=8",
                   help=f"sort-path tunings to time too (CUDA), ';' between variants, ',' "
                   f"between settings of {TUNABLE}; '' for none")  # fmt: skip
    return p.parse_args(argv)


def parse_variants(text: str) -> list[dict[str, int]]:
    """`"UPDATE_ROWS=4;CHUNK=64,HEADS=8"` -> `[{"UPDATE_ROWS": 4}, {"CHUNK": 64, "HEADS": 8}]`."""
    variants = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        settings = {}
        for item in part.split(","):
            name, _, value = item.partition("=")
            name = name.strip().upper()
            if name not in TUNABLE or not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"a variant sets {TUNABLE} to positive integers, got {item!r}")
            settings[name] = int(value)
        variants.append(settings)
    return variants


def variant_name(settings: dict[str, int]) -> str:
    return "sort[" + ",".join(f"{k}={v}" for k, v in settings.items()) + "]"


@contextlib.contextmanager
def tuned(settings: dict[str, int]) -> Iterator[None]:
    """The sort path's launches with `settings` in place of its constants, then restored."""
    from loka.zoo import rowwise_adagrad

    saved = {name: getattr(rowwise_adagrad, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(rowwise_adagrad, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(rowwise_adagrad, name, value)


def lookup_stats(rows: Any) -> dict[str, int]:
    """Lookups, distinct rows and the hottest row's count of a gradient's row indices."""
    import torch

    if rows.numel() == 0:
        return {"lookups": 0, "distinct_rows": 0, "hottest_row_lookups": 0}
    _, counts = torch.unique(rows, return_counts=True)
    return {
        "lookups": int(rows.numel()),
        "distinct_rows": int(counts.numel()),
        "hottest_row_lookups": int(counts.max()),
    }


def make_step(method: str, weight: Any) -> Any:
    """A step function of `method` over `weight` (its gradient set), with its own state."""
    from loka.zoo.optim import RowWiseAdagrad, lookup_rows
    from loka.zoo.rowwise_adagrad import rowwise_adagrad_sparse_reference_

    if method in ("coalesce", "sort"):
        optimizer = RowWiseAdagrad([weight], dedupe=method)
        return optimizer.step, lambda: optimizer.state[weight]["sum"]
    if method.startswith("sort[") and method.endswith("]"):
        settings = parse_variants(method[5:-1])[0]
        optimizer = RowWiseAdagrad([weight], dedupe="sort")

        def tuned_step() -> None:
            with tuned(settings):
                optimizer.step()

        return tuned_step, lambda: optimizer.state[weight]["sum"]
    if method != "sort-torch":
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    import torch

    state = torch.zeros(weight.size(0), dtype=torch.float32, device=weight.device)

    @torch.no_grad()
    def step() -> None:
        rows, values = lookup_rows(weight.grad)
        rowwise_adagrad_sparse_reference_(weight, state, rows, values, lr=0.05, eps=1e-8)

    return step, lambda: state


def host_ms(fn: Any, device: Any, reps: int) -> float:
    """Median milliseconds until `fn` returns (no sync after it: the host's time)."""
    import torch

    cuda = str(device).startswith("cuda")
    times = []
    for _ in range(max(1, reps)):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import loka.zoo as zoo
    from loka.zoo.data import SyntheticCriteo
    from loka.zoo.layers import FeatureEmbeddings

    budget = Budget(args.budget_s)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = args.preset or ("tiny" if args.smoke else "xl")
    model_config, data_config, batch_size = zoo.preset_config(
        args.model, preset, batch_size=args.batch_size
    )
    if not hasattr(data_config, "cardinalities"):
        raise ValueError(f"{args.model} has no Criteo-like tables; take dlrm, dhen or wukong")
    torch.manual_seed(0)
    with torch.device(device):
        bags = FeatureEmbeddings(data_config.cardinalities, model_config.embedding_dim, sparse=True)
    batch = SyntheticCriteo(data_config, batch_size, device=device).batch(0)["sparse"]
    upstream = torch.randn(batch.size(0), batch.size(1), bags.dim, device=device)

    bags(batch).backward(upstream)
    weight = bags.bags.weight
    grad = weight.grad
    config = {
        "model": args.model,
        "preset": preset,
        "batch_size": batch_size,
        "table_rows": weight.size(0),
        "dim": weight.size(1),
        "features": len(data_config.cardinalities),
        **lookup_stats(grad._indices()[0]),
    }
    methods = [m for m in METHODS if m != "sort-torch" or device.type == "cuda"]
    if device.type == "cuda":  # the tunings are the Triton kernels'
        methods += [variant_name(v) for v in parse_variants(args.variants)]
    touched = grad._indices()[0].unique()
    start = weight.detach()[touched].clone()
    steps, after = {}, {}
    for method in methods:  # each from the same start, on the rows the batch touched
        step, state = make_step(method, weight)
        step()
        after[method] = (weight.detach()[touched].clone(), state()[touched].clone())
        with torch.no_grad():
            weight[touched] = start
        steps[method] = step
    want_weight, want_state = after["coalesce"]
    rows = []
    for method in methods:
        got_weight, got_state = after[method]
        row: dict[str, Any] = {
            "method": method,
            "max_abs_err_weight": float((got_weight - want_weight).abs().max()),
            "max_rel_err_state": float(
                ((got_state - want_state).abs() / want_state.abs().clamp_min(1e-30)).max()
            ),
        }
        if budget.over():
            row["skipped"] = "budget"
        else:
            row["ms"] = time_ms(steps[method], device)
            row["host_ms"] = host_ms(steps[method], device, args.reps)
        rows.append(row)
    base = rows[0].get("ms")
    for row in rows:
        if base and row.get("ms"):
            row["speedup_vs_coalesce"] = base / row["ms"]
    context = {} if budget.over() else lookup_context(bags, batch, upstream, args)
    return {"config": config, "rows": rows, "context": context}


def lookup_context(bags: Any, batch: Any, upstream: Any, args: argparse.Namespace) -> dict:
    """The lookup's forward + backward, device and host time: as the model runs it
    (`padding_idx=0`: the sparse backward drops padding lookups with a boolean mask, whose
    size the host must learn), for the host-time question only the same bag with no
    padding index (every lookup kept: no mask, but not the model's gradient), and the fused
    option (`OptimizerConfig(fused_tables=True)`: the row-wise update inside the backward, so
    its time is the lookup's and the update's together; compare it with the model's lookup
    plus a step of the rows above)."""
    import torch
    import torch.nn.functional as F

    from loka.zoo.layers import global_rows
    from loka.zoo.rowwise_adagrad import FusedBagUpdate

    weight = bags.bags.weight
    rows = global_rows(batch, bags.row_offsets).flatten(0, 1)
    device = weight.device
    context = {}
    for name, padding_idx in (("padding_idx=0", 0), ("no padding_idx", None)):

        def lookup_backward(padding_idx: int | None = padding_idx) -> None:
            weight.grad = None
            out = F.embedding_bag(rows, weight, mode="sum", sparse=True, padding_idx=padding_idx)
            out.backward(upstream.flatten(0, 1))

        context[name] = {
            "ms": time_ms(lookup_backward, device),
            "host_ms": host_ms(lookup_backward, device, args.reps),
        }
    trigger = torch.zeros((), device=device, requires_grad=True)
    table = weight.detach()  # updated in place by the backward, as a fused table is
    state = torch.zeros(table.size(0), dtype=torch.float32, device=device)

    def fused_backward() -> None:
        out = FusedBagUpdate.apply(trigger, table, rows, state, 0.05, 1e-8, 0)
        out.backward(upstream.flatten(0, 1))

    context["fused update in backward"] = {
        "ms": time_ms(fused_backward, device),
        "host_ms": host_ms(fused_backward, device, args.reps),
    }
    return context


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    result = run(args)
    mode = "smoke" if args.smoke else result["config"]["preset"]
    device = args.device or ("cuda" if _cuda() else "cpu")
    record = {"meta": metadata(device, mode=mode, budget_s=args.budget_s), **result}
    path = write_json(Path(args.out) / f"sparse_update_{mode}_{stamp()}.json", record)
    config = result["config"]
    print(
        f"{config['model']} {config['preset']}: {config['table_rows']} rows x {config['dim']}, "
        f"{config['lookups']} lookups of {config['distinct_rows']} rows "
        f"(hottest {config['hottest_row_lookups']})"
    )
    for row in result["rows"]:
        print(
            f"  {row['method']:<11} {row.get('ms', float('nan')):9.3f} ms  host "
            f"{row.get('host_ms', float('nan')):8.3f} ms  x{row.get('speedup_vs_coalesce', 1):.2f}"
            f"  err w {row['max_abs_err_weight']:.2e} state {row['max_rel_err_state']:.2e}"
        )
    for name, times in result["context"].items():
        print(f"  lookup fwd+bwd, {name}: {times['ms']:.3f} ms, host {times['host_ms']:.3f} ms")
    print(f"wrote {path}")
    return path


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
