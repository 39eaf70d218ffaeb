"""Issue 14's end-to-end table, assembled from recorded `bench/realized.py` runs.

A `realized.py` call on the H200 fits a model or two in three modes (its limit is 10
minutes), so the table of every zoo model in every mode comes from several runs. This
script reads their JSON (`.json` or `.json.xz`), keeps for each (model, mode, variant) the
row of the latest run that has it, and writes `e2e_<utc>.json` whose `runs` rows carry
what the issue asks for: `model`, `preset`, `mode`, `variant`, `step_ms` or `fwd_ms`,
`speedup_vs_bf16` **against the median of the bf16 seeds timed in the same run and mode**
(the run's own `speedup_vs_bf16`, against seed 0, stays as `speedup_vs_bf16_seed0`),
`quality_ok` (None where no run trained a quality band; False if any trained draw of the
variant, in any run or from any seed, fell outside its run's bf16 band, each draw in
`quality_draws`), and for LoKA
`predicted_speedup`, `ceiling` and `demoted`; each row names its `source` file and commit.
`missing` lists the cells no run has recorded (a variant a run could not time is a row
with its `error` or `skipped` line, not missing).

    python3 bench/e2e_table.py bench/results/realized_20261204T1[6-9]*.json* --preset large
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from pathlib import Path

from harness import load, parser, stamp, write_json

realized = load("realized")  # its variants and seeds; importing it runs nothing

MODELS = ("dlrm", "dhen", "wukong", "interformer", "hstu")
MODES = ("compiled", "cudagraphs", "eager")  # the order of the table's lines
TRAINING = realized.VARIANTS
SERVING = ("infer-bf16", "infer-torchao-rowwise", "infer-loka")
LOKA_FIELDS = ("predicted_speedup", "predicted_from_step", "ceiling", "ceiling_step",
               "demoted", "fp8_layers", "passes_fp8", "verify_lines")  # fmt: skip
KEPT = ("step_ms", "fwd_ms", "blocks_ms", "ratio_min", "ratio_max", "quality", "quality_ok",
        "grad_ok", "grad_min_cosine", "fp8_layers", "error", "skipped", "batch_size",
        "embedding_update", "dynamic", "quality_band", "quality_vs_own_seed", "seed",
        "output_rel_err", "output_rel_err_note", "output_spread", "fp8_calls", "g",
        "serving_estimated")  # fmt: skip
# One trained draw of a variant's quality (realized.py's quality phase).
QUALITY_FIELDS = ("seed", "quality", "quality_ok", "quality_band", "quality_vs_own_seed",
                  "loss_last", "loss_max_rise", "loss_max_rise_step")  # fmt: skip


def parse_args(argv: list[str] | None = None):
    p = parser(__doc__)
    p.add_argument("files", nargs="+", help="realized_*.json or .json.xz")
    p.add_argument("--preset", default="large")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rename", action="append", default=[], metavar="AS_RUN:NAME",
                   help="file a variant under the table's name for it (repeatable), e.g. "
                        "loka+mk:loka when the runs of a preset timed LoKA with options")  # fmt: skip
    p.add_argument("--markdown", action="store_true",
                   help="also print the training rows as a Markdown table (one line per model "
                        "and mode), for a README")  # fmt: skip
    return p.parse_args(argv)


def renames(items: list[str]) -> dict[str, str]:
    """``--rename AS_RUN:NAME`` pairs as a mapping (variant names hold ``=`` and ``+``, so
    a colon separates them); one line naming a malformed or repeated one."""
    out: dict[str, str] = {}
    for item in items:
        old, sep, new = item.partition(":")
        if not sep or not old or not new:
            raise ValueError(f"--rename {item!r}: expected AS_RUN:NAME, e.g. loka+mk:loka")
        if old in out:
            raise ValueError(f"--rename: {old!r} renamed twice")
        out[old] = new
    return out


def read_run(path: str | Path) -> dict:
    """One recorded run; one line naming the file if it is not a realized.py result."""
    path = Path(path)
    raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path.name}: no 'runs' list: not a bench/realized.py result")
    return data


def is_band_seed(variant: str) -> bool:
    """A bf16 seed of the noise band, training or serving (`realized.is_band_seed`)."""
    return realized.is_band_seed(variant.removeprefix("infer-"))


def seed_median(rows: list[dict], serving: bool, batch=None) -> float | None:
    """Median step (or forward) time of the run's bf16 seeds in one mode."""
    key = "fwd_ms" if serving else "step_ms"
    times = [r[key] for r in rows
             if is_band_seed(r["variant"]) and r["variant"].startswith("infer-") == serving
             and r.get(key) is not None and r.get("batch_size") == batch]  # fmt: skip
    return statistics.median(times) if times else None


def table_rows(data: dict, source: str, preset: str, rename: dict | None = None) -> list[dict]:
    """The run's rows of one preset, with the speedup against its own seeds' median;
    `rename` maps a variant as run to the table's name for it (``loka+mk`` -> ``loka``;
    the row keeps the name it ran as in `variant_as_run`)."""
    meta = data.get("meta", {})
    rows = [r for r in data["runs"] if r.get("preset", meta.get("preset")) == preset
            and all(k in r for k in ("model", "mode", "variant"))]  # fmt: skip
    if rename:
        rows = [r | {"variant": rename[r["variant"]], "variant_as_run": r["variant"]}
                if r["variant"] in rename else r for r in rows]  # fmt: skip
    out = []
    for r in rows:
        serving = r["variant"].startswith("infer-")
        same_mode = [x for x in rows if (x["model"], x["mode"]) == (r["model"], r["mode"])]
        base = seed_median(same_mode, serving, r.get("batch_size"))
        ms = r.get("fwd_ms" if serving else "step_ms")
        row = {"model": r["model"], "preset": preset, "mode": r["mode"],
               "variant": r["variant"],
               "speedup_vs_bf16": base / ms if base and ms else None,
               "speedup_vs_bf16_seed0": r.get("speedup_vs_bf16"),
               "quality_ok": r.get("quality_ok"),
               "source": source, "commit": (meta.get("git_commit") or "")[:7] or None}  # fmt: skip
        row |= {k: r[k] for k in (*KEPT, "variant_as_run")
                if r.get(k) is not None and k != "quality_ok"}  # fmt: skip
        if r["variant"].startswith(("loka", "infer-loka")):
            row |= {k: r.get(k) for k in LOKA_FIELDS}
        out.append(row)
    return out


def quality_variant(variant: str) -> tuple[str, int | None]:
    """A variant trained from another bf16 seed (``loka@seed=1``) is a quality draw of its
    base variant (``loka``), not a cell of its own: (the base, the seed); (variant, None)
    for any other."""
    base, extra = realized.split_variant(variant)
    if set(extra) == {"seed"}:
        return base, extra["seed"]
    return variant, None


def assemble(
    runs: list[tuple[str, dict]], preset: str, models=MODELS, rename: dict | None = None
) -> dict:
    """Rows of the latest run per (model, mode, variant, batch); runs in recording order
    (their file names carry the UTC stamp). A row with no timing (a budget-cut variant)
    does not replace a timed one. Quality is not the latest run's alone: every trained draw
    of a variant, from every run and seed, goes into its `quality_draws`, and `quality_ok`
    holds only if every draw was inside its run's bf16 band (one training that lands outside
    is what a user would meet)."""
    cells: dict[tuple, dict] = {}
    draws: dict[tuple, list[dict]] = {}
    for source, data in sorted(runs, key=lambda item: item[0]):
        rows = table_rows(data, source, preset, rename)
        # A run that trained bf16 alone in a mode (a serving run needs its weights) has no
        # training comparison there: its bf16 row does not replace the one an A/B run timed
        # beside its seeds and LoKA, whose speedups the table's line reads with it.
        compared = {(r["model"], r["mode"]) for r in rows
                    if r.get("step_ms") and r["variant"] != "bf16"}  # fmt: skip
        for row in rows:
            if row["model"] not in models:
                continue
            variant, seed = quality_variant(row["variant"])
            if row.get("quality") is not None:
                draws.setdefault((row["model"], row["mode"], variant), []).append(
                    {k: row.get(k) for k in QUALITY_FIELDS} | {"source": source}
                )
            if seed is not None:
                continue
            key = (row["model"], row["mode"], row["variant"], row.get("batch_size"))
            if (
                row["variant"] == "bf16"
                and (row["model"], row["mode"]) not in compared
                and (key in cells)
            ):
                continue
            timed = row.get("step_ms") or row.get("fwd_ms")
            outcome = timed or row.get("error") or row.get("skipped")
            if outcome or key not in cells:
                cells[key] = row
    for (model, mode, variant, batch), cell in cells.items():
        found = draws.get((model, mode, variant)) if batch is None else None
        if found:
            cell["quality_draws"] = found
            cell["quality_ok"] = all(d["quality_ok"] is not False for d in found)
            cell["quality"] = found[-1]["quality"]
    have = {(m, mode, v) for m, mode, v, _ in cells}
    missing = [f"{m}/{mode}/{v}" for m in models for mode in MODES
               for v in (*TRAINING, *SERVING) if (m, mode, v) not in have]  # fmt: skip
    no_quality = sorted({f"{r['model']}/{r['mode']}" for r in cells.values()
                         if r["variant"] == "loka" and r.get("quality_ok") is None})  # fmt: skip
    return {"runs": sorted(cells.values(), key=order), "missing": missing,
            "no_quality": no_quality}  # fmt: skip


def untimed_reason(row: dict, width: int) -> str:
    """Why a row holds no time, in one line of at most `width` characters: its error, why
    it was skipped, or "not timed"."""
    return (row.get("error") or row.get("skipped") or "not timed").splitlines()[0][:width]


def order(row: dict) -> tuple:
    model = MODELS.index(row["model"]) if row["model"] in MODELS else len(MODELS)
    mode = MODES.index(row["mode"]) if row["mode"] in MODES else len(MODES)
    return model, mode, row["variant"].startswith("infer-"), row["variant"]


def report(table: dict) -> str:
    lines = [f"{'model':<12}{'mode':<11}{'variant':<26}{'ms':>9}{'x seeds':>9}{'pred':>7}"
             f"{'quality_ok':>11}  source"]  # fmt: skip
    for r in table["runs"]:
        ms = r.get("step_ms", r.get("fwd_ms"))
        if ms is None:
            what = untimed_reason(r, 48)
            lines.append(f"{r['model']:<12}{r['mode']:<11}{r['variant']:<26}  {what}")
            continue
        pred = r.get("predicted_from_step") or r.get("predicted_speedup")
        lines.append(f"{r['model']:<12}{r['mode']:<11}{r['variant']:<26}{ms:>9.2f}"
                     f"{r['speedup_vs_bf16']:>9.3f}{pred or float('nan'):>7.3f}"
                     f"{r.get('quality_ok')!s:>11}  {r['source']}")  # fmt: skip
    lines.append(f"missing: {len(table['missing'])} cells ({', '.join(table['missing'][:8])}"
                 f"{', ...' if len(table['missing']) > 8 else ''})")  # fmt: skip
    lines.append(f"LoKA rows without quality: {', '.join(table['no_quality']) or 'none'}")
    return "\n".join(lines)


def markdown(table: dict) -> str:
    """One line per model and mode, speedups against bf16 seed 0 as the run timed them (its
    blocks' ratio range in brackets) and LoKA's against the seeds' median too: bf16 (seed
    0's step, seeds 1 and 2), torchao tensorwise, LoKA (its FP8 sites), predicted (plan /
    from the step) and the ceilings (share-based / from the step)."""
    cells = {(r["model"], r["mode"], r["variant"]): r for r in table["runs"]
             if r.get("batch_size") is None}  # fmt: skip

    def x(value) -> str:
        return "-" if value is None else f"{value:.3f}x"

    def outcome(row) -> str | None:
        if row is None:
            return "not run"
        if row.get("step_ms") is None:
            return untimed_reason(row, 60)
        return None

    def quality(row) -> str:
        found = (row or {}).get("quality_draws") or []
        inside = sum(d["quality_ok"] is not False for d in found)
        return f"{inside} of {len(found)} in band" if found else "-"

    lines = ["| model | mode | bf16 step, seeds 1/2 | torchao tensorwise-auto | LoKA (sites) "
             "| LoKA vs the seeds' median | predicted: plan / step | ceiling: share / step "
             "| LoKA quality draws |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    pairs = sorted({k[:2] for k in cells},
                   key=lambda k: order({"model": k[0], "mode": k[1], "variant": ""}))  # fmt: skip
    for model, mode in pairs:
        bf16, loka, tao, seed1, seed2 = (
            cells.get((model, mode, v))
            for v in ("bf16", "loka", "torchao-tensorwise-auto", "bf16-seed1", "bf16-seed2")
        )
        seeds = " / ".join(outcome(s) or x(s["speedup_vs_bf16_seed0"]) for s in (seed1, seed2))
        base = outcome(bf16) or f"{bf16['step_ms']:.2f} ms, {seeds}"
        fp8 = outcome(loka) or x(loka["speedup_vs_bf16_seed0"])
        if not outcome(loka) and loka.get("ratio_min") is not None:
            fp8 += f" [{loka['ratio_min']:.3f}, {loka['ratio_max']:.3f}]"
        if not outcome(loka) and loka.get("fp8_layers") is not None:
            fp8 += f" ({loka['fp8_layers']})"
        vs_seeds = "-" if outcome(loka) else x(loka["speedup_vs_bf16"])
        pred = (
            "-"
            if loka is None
            else (f"{x(loka.get('predicted_speedup'))} / {x(loka.get('predicted_from_step'))}")
        )
        ceil = "-" if loka is None else f"{x(loka.get('ceiling'))} / {x(loka.get('ceiling_step'))}"
        lines.append(f"| {model} | {mode} | {base} | "
                     f"{outcome(tao) or x(tao['speedup_vs_bf16_seed0'])} | {fp8} | {vs_seeds} "
                     f"| {pred} | {ceil} | {quality(loka)} |")  # fmt: skip
    return "\n".join(lines)


def serving_markdown(table: dict) -> str:
    """One line per model, mode and served batch: bf16's forward, then each FP8 serving
    variant's speedup (its blocks' range in brackets, its FP8 sites, what verification
    demoted), LoKA's prediction from the forward and its ceiling (estimated where the batch
    is not the training one); "" when no run served."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in table["runs"]:
        if r["variant"].startswith("infer-") and r.get("batch_size") is not None:
            groups.setdefault((r["model"], r["mode"], r["batch_size"]), {})[r["variant"]] = r
    if not groups:
        return ""
    lines = ["| model | mode | batch | bf16 forward | FP8 variants (sites; demoted) "
             "| LoKA predicted / ceiling |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip

    def place(key: tuple) -> tuple:
        model, mode, batch = key
        return (*order({"model": model, "mode": mode, "variant": ""})[:2], batch)

    for (model, mode, batch), rows in sorted(groups.items(), key=lambda kv: place(kv[0])):
        bf16 = rows.get("infer-bf16", {})
        base = f"{bf16['fwd_ms']:.2f} ms" if bf16.get("fwd_ms") else "not timed"
        parts, loka = [], None
        for variant, r in sorted(rows.items()):
            if variant == "infer-bf16":
                continue
            if r.get("fwd_ms") is None:
                parts.append(f"{variant.removeprefix('infer-')}: {untimed_reason(r, 40)}")
                continue
            text = f"{variant.removeprefix('infer-')} {r['speedup_vs_bf16_seed0']:.3f}x"
            if r.get("ratio_min") is not None:
                text += f" [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]"
            if r.get("fp8_layers") is not None:
                text += f" ({r['fp8_layers']}"
                text += f"; {len(r['demoted'])} demoted)" if r.get("demoted") else ")"
            parts.append(text)
            if variant.startswith("infer-loka") and loka is None:
                loka = r
        pred = "-"
        if loka is not None and loka.get("predicted_from_step") is not None:
            ceiling = loka.get("ceiling_step")
            pred = f"{loka['predicted_from_step']:.3f}x / " + (
                "-" if ceiling is None else f"{ceiling:.3f}x"
            )
            pred += " (estimated)" if loka.get("serving_estimated") else ""
        lines.append(f"| {model} | {mode} | {batch} | {base} | {'; '.join(parts) or '-'} "
                     f"| {pred} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = [(Path(f).name, read_run(f)) for f in args.files]
    except (OSError, ValueError) as e:
        print(f"e2e_table: {e}", file=sys.stderr)
        return 2
    models = tuple(m for m in args.models.split(",") if m)
    try:
        rename = renames(args.rename)
    except ValueError as e:
        print(f"e2e_table: {e}", file=sys.stderr)
        return 2
    table = assemble(runs, args.preset, models, rename)
    print(report(table))
    if args.markdown:
        print(markdown(table))
        if serving := serving_markdown(table):
            print(serving)
    sources = sorted({r["source"] for r in table["runs"]})
    meta = {"command": " ".join(sys.argv), "preset": args.preset, "sources": sources,
            "rename": rename,
            "from": "bench/realized.py runs on the H200, assembled by bench/e2e_table.py"}  # fmt: skip
    path = write_json(Path(args.out) / f"e2e_{stamp()}.json", {"meta": meta, **table})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
