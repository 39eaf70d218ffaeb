"""Group the kernel rows of `bench/realized.py --profile` tables (torch.profiler's
key_averages table, 160-character names) by kind, per step: FP8 GEMMs (cuBLAS `qq` kernels),
bf16 GEMMs, fused attention (cuDNN, flash, memory-efficient), Triton kernels that quantize
(amax / _scaled_mm operands / pow2 bit masks), other Triton, the optimizers, the rest.
Device-side rows only (self CPU 0), so a Triton kernel is not counted twice with its
launcher row.

    python bench/profile_summary.py bench/results/profiles_wukong_xl_20261202T0618Z/*.txt

`--top N` lists each table's N largest kernel families per step under its kinds: where
InterFormer xl's compiled step showed cuDNN's attention at 25 of 124 ms, which the kinds
alone had left inside "other".

`--diff BASE` prints, for each table against BASE (e.g. a plan's step against bf16's), the
change per kind and the kernels whose time grew or shrank most, matched by name less
inductor's trailing index (`triton_red_fused_..._10` and `..._31` are one family): where a
planned step loses what its GEMMs save.

    python bench/profile_summary.py --diff profile_dhen_compiled_bf16.txt profile_dhen_compiled_loka.txt

`--plan RUN.json` (with `--diff`; `--variant` picks the plan, `--kernel-bench` the timings
it was made from) adds the plan's prediction in parts beside the profiles: its FP8 passes'
bf16 GEMMs, FP8 GEMMs and quantization as the kernel bench timed them, and what the two
profiles say they took in the step (the bf16 GEMM time the plan removed, the FP8 GEMM time
it added, the net growth of the Triton kernels): which part of a prediction missed.

    python bench/profile_summary.py --diff ..._profiles/profile_hstu_compiled_bf16.txt \
        ..._profiles/profile_hstu_compiled_loka.txt --plan realized_....json \
        --kernel-bench bench/results/kernel_bench_xl_h200_20261203T0556Z.parquet
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def to_ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * UNITS[unit]


def kernel_rows(path: str, name_width: int = 160) -> list[tuple[str, float, int]]:
    """(name, self CUDA ms, calls) of each device-side row of a profile table."""
    rows = []
    for line in Path(path).read_text().splitlines():
        cols = line[name_width:].split()
        if len(cols) < 10 or line.startswith("-") or "Self CPU %" in line:
            continue
        self_cpu, self_cuda = to_ms(cols[1]), to_ms(cols[5])
        if self_cpu == 0 and self_cuda > 0:
            rows.append((line[:name_width].strip(), self_cuda, int(cols[9])))
    return rows


# cuBLAS's nvjet kernels name their operand types after the SM: `tst` bf16, `qqtst` e4m3 x
# e4m3, `qrtst` / `rqtst` e4m3 x e5m2 (a gradient in e5m2). Matching only `qqtst` once
# counted HSTU xl's e5m2 wgrad GEMMs as bf16 ones.
FP8_GEMM = re.compile(r"nvjet_sm\d+_[qr]{2}t")
# Fused attention kernels: cuDNN's (`cudnn_generated_fort_native_sdpa_...`), flash
# attention's, the memory-efficient one's (`fmha_cutlass...`, named after cutlass: checked
# before the GEMMs).
ATTENTION = re.compile(r"sdpa|flash_(fwd|bwd)|fmha|attention", re.IGNORECASE)


def kind(name: str) -> str:
    if ATTENTION.search(name):
        return "attention"
    if FP8_GEMM.search(name):
        return "fp8 gemm"
    if "nvjet" in name or "cutlass" in name or "gemm" in name.lower():
        return "bf16 gemm"
    if name.startswith("triton"):
        quant = any(k in name for k in ("amax", "scaled_mm", "bitwise"))
        return "triton w/ quant" if quant else "triton other"
    if "multi_tensor" in name or "adagrad" in name.lower():
        return "optimizer"
    return "other"


def family(name: str) -> str:
    """A kernel's name less inductor's trailing index: the same fused work in two graphs."""
    return re.sub(r"_\d+$", "", name)


def per_step(path: str, steps: int, key=kind) -> dict[str, float]:
    """ms per step of a table's kernels, summed by `key` of their names."""
    out: collections.Counter = collections.Counter()
    for name, cuda_ms, _ in kernel_rows(path):
        out[key(name)] += cuda_ms / steps
    return dict(out)


def diff_lines(base: str, table: str, steps: int, top: int = 8) -> list[str]:
    """`table` against `base`: ms per step by kind, then the kernel families that grew and
    shrank most."""
    lines = [f"{table} against {base}:"]
    a, b = per_step(base, steps), per_step(table, steps)
    for k in sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0))):
        lines.append(f"   {k:18s} {a.get(k, 0):7.2f} -> {b.get(k, 0):7.2f} ms/step "
                     f"({b.get(k, 0) - a.get(k, 0):+.2f})")  # fmt: skip
    fa, fb = per_step(base, steps, family), per_step(table, steps, family)
    change = {f: fb.get(f, 0) - fa.get(f, 0) for f in set(fa) | set(fb)}
    grew = sorted((f for f in change if change[f] > 0), key=lambda f: -change[f])[:top]
    shrank = sorted((f for f in change if change[f] < 0), key=lambda f: change[f])[:top]
    for title, names in (("grew most", grew), ("shrank most", shrank)):
        lines.append(f"   {title}:")
        lines += [f"     {change[f]:+7.2f} ms/step  {f[:110]}" for f in names]
    return lines


def planned_parts(run: str, variant: str | None, kernel_bench: str) -> dict[str, float]:
    """`parts_as_timed` of the plan recorded in `run` (a `bench/realized.py` JSON; the plan
    whose key ends in `variant`, or its only plan) against the timings in `kernel_bench`."""
    import json

    import polars as pl

    plans = json.loads(Path(run).read_text())["plans"]
    keys = [k for k in plans if variant is None or k.split("/")[-1] == variant]
    if len(keys) != 1:
        raise SystemExit(f"--plan: {len(keys)} plans match {variant!r} in {run}: {sorted(plans)}")
    try:
        return parts_as_timed(plans[keys[0]]["table"], pl.read_parquet(kernel_bench))
    except KeyError as e:
        raise SystemExit(f"--kernel-bench: {e.args[0]}") from None


def parts_as_timed(plan_rows: list[dict], kernel_bench) -> dict[str, float]:
    """ms of a plan's FP8 passes (its table's rows) as the kernel bench (a polars frame)
    timed them: their bf16 GEMMs, FP8 GEMMs, and quantization (the rest of each pass's
    predicted time, any in-place charge included). KeyError names a pass it has no row for."""
    import polars as pl

    from loka.dispatch.bench.candidates import m_bucket, speed_key

    # rows are timed once per speed key (pow2 and scale bounds change no time)
    bench = kernel_bench.with_columns(
        pl.col("recipe").map_elements(speed_key, return_dtype=pl.String).alias("speed")
    )
    parts = {"bf16": 0.0, "fp8 gemm": 0.0, "quant": 0.0}
    for r in plan_rows:
        if r["recipe"] == "bf16":
            continue
        timed = bench.filter(
            (pl.col("M_bucket") == m_bucket(r["M_p50"])) & (pl.col("K") == r["K"])
            & (pl.col("N") == r["N"]) & (pl.col("pass") == r["pass"])
            & (pl.col("backend") == r["backend"]) & (pl.col("speed") == speed_key(r["recipe"]))
        )  # fmt: skip
        if timed.is_empty():
            raise KeyError(f"no timing of {r['site']} {r['pass']} {r['recipe']}")
        gemm = timed["gemm_ms"][0]
        parts["bf16"] += r["bf16_ms"]
        parts["fp8 gemm"] += gemm
        parts["quant"] += r["predicted_ms"] - gemm
    return parts


def parts_in_step(base: str, table: str, steps: int) -> dict[str, float]:
    """What the step spent on a plan's FP8 passes, by its profile `table` against bf16's
    `base` (ms/step): the bf16 GEMM time removed, the FP8 GEMM time added, and the net
    growth of the Triton kernels (the quantization, less the elementwise work it absorbed)."""
    a, b = per_step(base, steps), per_step(table, steps)
    triton = ("triton w/ quant", "triton other")
    return {
        "bf16": a.get("bf16 gemm", 0) - b.get("bf16 gemm", 0),
        "fp8 gemm": b.get("fp8 gemm", 0) - a.get("fp8 gemm", 0),
        "quant": sum(b.get(k, 0) for k in triton) - sum(a.get(k, 0) for k in triton),
    }


def saving(parts: dict[str, float]) -> float:
    return parts["bf16"] - parts["fp8 gemm"] - parts["quant"]


def parts_lines(timed: dict[str, float], in_step: dict[str, float]) -> list[str]:
    """The plan's parts as timed beside what the profiles say they took in the step."""
    names = {"bf16": "bf16 GEMMs replaced", "fp8 gemm": "FP8 GEMMs", "quant": "quantization (net)"}
    lines = ["   the plan's FP8 passes, as timed -> in the step (ms/step):"]
    for k, name in names.items():
        ratio = timed[k] / in_step[k] if in_step[k] > 0 else float("nan")
        lines.append(
            f"     {name:22s} {timed[k]:8.2f} -> {in_step[k]:8.2f}  (timed/step {ratio:.2f})"
        )
    lines.append(f"     {'saving':22s} {saving(timed):8.2f} -> {saving(in_step):8.2f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tables", nargs="+")
    p.add_argument("--steps", type=int, default=4, help="steps the profile covered")
    p.add_argument("--diff", metavar="BASE", help="compare each table with this one")
    p.add_argument("--plan", metavar="RUN.json", help="with --diff: the plan's prediction in parts")
    p.add_argument("--variant", default=None,
                   help="which plan of --plan's run: the last part of its key (loka+mk; the "
                        "plain loka plan's key ends in its --dynamic setting, auto)")  # fmt: skip
    p.add_argument("--kernel-bench", default=None, help="the timings the plan was made from")
    p.add_argument("--top", type=int, default=0, help="also list the N largest kernel families")
    args = p.parse_args(argv)
    if args.plan and not (args.diff and args.kernel_bench):
        p.error("--plan needs --diff BASE (the bf16 profile) and --kernel-bench")
    planned = planned_parts(args.plan, args.variant, args.kernel_bench) if args.plan else None
    if args.diff:
        for path in args.tables:
            print("\n".join(diff_lines(args.diff, path, args.steps)))
            if planned is not None:
                in_step = parts_in_step(args.diff, path, args.steps)
                print("\n".join(parts_lines(planned, in_step)))
        return
    for path in args.tables:
        rows = kernel_rows(path)
        ms, launches = collections.Counter(), collections.Counter()
        for name, cuda_ms, calls in rows:
            ms[kind(name)] += cuda_ms / args.steps
            launches[kind(name)] += calls / args.steps
        print(f"{path}: listed kernels {sum(ms.values()):.2f} ms/step")
        for k, v in ms.most_common():
            print(f"   {k:18s} {v:7.2f} ms/step  {launches[k]:6.0f} launches/step")
        if args.top:
            print(f"   largest {args.top} kernel families:")
            families = per_step(path, args.steps, key=family)
            for name in sorted(families, key=families.get, reverse=True)[: args.top]:
                v = families[name]
                print(f"   {v:7.2f} ms/step  {kind(name):16s} {name[:110]}")


if __name__ == "__main__":
    main()
