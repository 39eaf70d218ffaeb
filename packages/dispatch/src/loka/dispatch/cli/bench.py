"""`loka bench`: the kernel_bench table for a model's GEMM shapes."""

from __future__ import annotations

import argparse
from pathlib import Path

from loka.dispatch.cli._common import fail, use_interpreter_without_gpu, user_errors


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="time every backend x recipe x pass at a model's GEMM shapes (kernel_bench)",
        description="Measure (on this GPU, through the cache) or, without one, estimate from a "
        "recorded table, the time of every candidate kernel at each shape; write kernel_bench.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--tables", type=Path, help="probe tables folder (its sites.parquet)")
    what.add_argument("--shapes", help="comma-separated MxKxN shapes, e.g. 16384x1024x4096")
    what.add_argument("--zoo-large", action="store_true",
                      help="the site shapes of the zoo's large dlrm, dhen, wukong and hstu")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("kernel_bench.parquet"),
                        help="kernel_bench table to write (default kernel_bench.parquet)")  # fmt: skip
    parser.add_argument("--cache", type=Path, default=None,
                        help="cache folder (default $LOKA_CACHE_DIR or ~/.cache/loka)")  # fmt: skip
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    parser.add_argument("--budget-s", type=float, default=180.0, help="time budget (180 s)")
    parser.add_argument("--estimate-from", default="shipped",
                        help="recorded kernel_bench used without a GPU or past the budget: "
                        "'shipped' (the H200 table), a parquet path, or 'none'")  # fmt: skip
    parser.add_argument("--recipes-from-errors", action="store_true",
                        help="time the recipes probed in --tables' site_errors (default: the usual set)")  # fmt: skip
    parser.add_argument("--fast-accum", action="store_true", help="also time .fast backends")
    parser.add_argument("--device", default=None,
                        help="GPU to time on, e.g. cuda:1 (default: the current one)")  # fmt: skip
    parser.set_defaults(func=run)


# Beyond these an operand alone outgrows a GPU's memory (2**32 bf16 elements: 8 GiB).
MAX_DIM = 1 << 24
MAX_OPERAND = 1 << 32


def _parse_shapes(text: str):
    from loka.dispatch.bench import Shape, m_bucket

    shapes = []
    for part in text.split(","):
        try:
            M, K, N = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: {part!r} is not MxKxN") from None
        if min(M, K, N) < 1:
            raise ValueError(f"--shapes: {part!r} has a non-positive size")
        if max(M, K, N) > MAX_DIM or max(M * K, K * N, M * N) > MAX_OPERAND:
            raise ValueError(
                f"--shapes: {part!r} is beyond what one GPU can time (each size at most "
                f"{MAX_DIM}, each operand at most {MAX_OPERAND} elements)"
            )
        shapes.append(Shape(m_bucket(M), K, N))
    return list(dict.fromkeys(shapes))


def run(args: argparse.Namespace) -> int:
    use_interpreter_without_gpu()
    from loka.dispatch.bench import BenchCache, CostModel, benchmark, site_shapes
    from loka.dispatch.console import console, progress_bar
    from loka.schema import write_table

    try:
        recipes, norm_shapes = None, []
        if args.tables is not None:
            from loka.dispatch.tables import load_probe_tables

            tables = load_probe_tables(args.tables)
            shapes = site_shapes(tables["sites"])
            if args.recipes_from_errors:
                errors = tables["site_errors"]
                recipes = {p: errors.filter(errors["pass"] == p)["recipe"].unique().to_list()
                           for p in ("fwd", "dgrad", "wgrad")}  # fmt: skip
        elif args.shapes:
            shapes = _parse_shapes(args.shapes)
        else:
            from loka.dispatch.workloads import norm_shapes_of, shapes_of, zoo_shapes

            console.print("collecting the large zoo models' site shapes ...")
            per_model = zoo_shapes()
            shapes, norm_shapes = shapes_of(per_model), norm_shapes_of(per_model)
        cost_model = None
        if args.estimate_from == "shipped":
            cost_model = CostModel.shipped()
        elif args.estimate_from != "none":
            cost_model = CostModel.from_file(args.estimate_from)
        cache = None if args.no_cache else BenchCache(args.cache)
        with progress_bar(f"kernel_bench: {len(shapes)} shape(s)") as update:
            result = benchmark(shapes, device=args.device, cache=cache, cost_model=cost_model,
                               budget_s=args.budget_s, include_fast_accum=args.fast_accum,
                               recipes=recipes, progress=update, norm_shapes=norm_shapes)  # fmt: skip
    except user_errors() as exc:
        return fail(str(exc))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_table(result.table, args.out, "kernel_bench",
                metadata={"device": result.device.describe()})  # fmt: skip
    console.print(
        f"{result.table.height} rows for {result.device.device}: {result.measured} measured, "
        f"{result.reused} from the cache, {result.estimated} estimated; {len(result.refused)} "
        f"refused by their backend, {len(result.failed)} without a time"
    )
    for note in result.notes:
        console.print(f"  {note}")
    if result.is_estimate:
        console.print("[bold yellow]ESTIMATED: these times are not measurements on this machine[/]")
    console.print(f"wrote {args.out}")
    return 0
