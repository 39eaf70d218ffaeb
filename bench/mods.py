"""loka-mods on the GPU: forward+backward time of the FP8 modules against bf16 and torchao,
side by side in one run, every path checked for its error first.

Sections (one CSV row per path and shape; ratios are to the bf16 row of the same shape):
- linear:   ``nn.Linear`` in bf16 vs `Fp8Linear` (rowwise and tensorwise recipes on each
            FP8 backend, and with only some passes in FP8) vs torchao's `Float8Linear`
            (tensorwise and rowwise, eager and compiled), at the zoo models' shapes.
            "ours best" is the fastest Fp8Linear configuration of the shape.
- lnlinear: LayerNorm -> Linear: bf16, LayerNorm + Fp8Linear (unfused), `NormLinear` (the
            norm and the quantization of its output in one kernel), torchao compiled;
            training (fwd+bwd) and inference (fwd, no grad).
- grouped:  G small linears over [B, G, K] features (per-feature projections): the loop of
            nn.Linear, `GroupedLinear` bmm, `GroupedLinear` FP8 (grouped Triton GEMM).
Times are `triton.testing.do_bench` medians of one training step of the module
(``autograd.grad`` of the output for the input and every parameter), eager unless a row
says compiled; bf16 parameters and inputs.

    python bench/mods.py --smoke     # CPU (Triton interpreter) or GPU, tiny shapes, < 1 min
    python bench/mods.py             # one H200, ~3 min (--budget-s caps it)
Results: mods_<mode>_<utc time>.csv (rows) and .json (metadata, summary, aims) in --out
(default $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first import of loka.kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from harness import Budget, metadata, parser, rel_err, stamp, time_ms, write_csv, write_json  # noqa: E402
from torch import nn  # noqa: E402

from loka.mods import Fp8Linear, Fp8LinearConfig, PassConfig  # noqa: E402
from loka.mods.grouped import GroupedLinear, GroupLayout  # noqa: E402
from loka.mods.norm_linear import fuse_pair  # noqa: E402

FIELDS = [
    "section",
    "shape",
    "path",
    "impl",
    "recipe",
    "compiled",
    "train",
    "M",
    "K",
    "N",
    "G",
    "t_ms",
    "speedup_vs_bf16",
    "rel_err",
    "ok",
    "error",
]
ROW = "e4m3:e4m3/row/dynamic"
TENSOR_FWD, TENSOR_GRAD = "e4m3:e4m3/tensor/dynamic", "e5m2:e4m3/tensor/dynamic"
ERR_BOUND = 0.08  # FP8 e4m3/e5m2 GEMM errors are 3.7e-2 / 5.8e-2 on normal data
DEVICE = torch.device("cuda" if CUDA else "cpu")
ROWS: list[dict] = []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, budget_s=170.0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one call per path")
    p.add_argument("--sections", default="linear,lnlinear,grouped")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile rows")
    return p.parse_args(argv)


# Set by main() from the command line; importing the script runs nothing.
ARGS = parse_args([])
MODE = "full"
BUDGET = Budget(None)

# (name, M, K, N): the zoo's large presets (packages/zoo registry) and the brief's grid.
LINEAR_SHAPES = {
    "smoke": [("tiny", 32, 64, 48)],
    "full": [
        ("dhen block fc1", 16384, 1024, 4096),
        ("dhen block fc2", 16384, 4096, 1024),
        ("sasrec ffn_in", 51200, 1024, 4096),
        ("sasrec qkv", 51200, 1024, 3072),
        ("hstu out", 41000, 1024, 1024),
        ("wukong fm mlp", 16384, 1024, 2048),
        ("dlrm top 479", 65536, 479, 1024),
        ("dhen input_projection", 16384, 656, 1024),
        ("512x512", 16384, 512, 512),
        ("dhen head", 16384, 1024, 512),
        ("128x128", 16384, 128, 128),
    ],
}
LN_SHAPES = {
    "smoke": [("tiny", 32, 64, 48)],
    "full": [
        ("dhen block", 16384, 1024, 4096),
        ("sasrec qkv", 51200, 1024, 3072),
        ("hstu uvqk", 41000, 1024, 4096),
        ("512x512", 16384, 512, 512),
    ],
}
GROUP_SHAPES = {
    "smoke": [("tiny", 3, 16, 32, 16)],
    "full": [("dhen projections", 32, 16384, 128, 128), ("16x256", 16, 16384, 256, 256)],
}
COMPILED_SHAPES = 3  # torchao/ours compiled on the first shapes only: compiles cost ~10 s each


# ---------------------------------------------------------------------------------- helpers
def elapsed() -> float:
    return BUDGET.elapsed()


# Each section's share of --budget-s; time a section leaves unused goes to the next ones.
SHARES = {"linear": 0.6, "lnlinear": 0.25, "grouped": 0.15}
SECTION_DEADLINE = [math.inf]


def over_budget() -> bool:
    return BUDGET.over() or elapsed() > SECTION_DEADLINE[0]


def start_section(section: str, remaining: list[str]) -> None:
    SECTION_DEADLINE[0] = BUDGET.share(SHARES[section] / sum(SHARES[s] for s in remaining))


def record(section: str, shape: str, path: str, fn: Callable[[], object], **fields) -> dict:
    """Time `fn` and append a row; `check()` (optional, in fields) gives its relative error
    against the bf16 path first. Any exception becomes an error row, never a crash."""
    check = fields.pop("check", None)
    row = {"section": section, "shape": shape, "path": path, "ok": True, "error": "", **fields}
    if over_budget():
        row.update(ok=False, error="skipped: past this section's share of --budget-s")
        ROWS.append(row)
        return row
    try:
        if check is not None:
            row["rel_err"] = check()
            row["ok"] = bool(row["rel_err"] <= ERR_BOUND)
        # On the CPU one timed call proves the path runs; its time means little.
        row["t_ms"] = time_ms(fn, DEVICE, reps=1)
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        if CUDA:
            torch.cuda.synchronize()
    ROWS.append(row)
    return row


def step_fn(
    module: Callable,
    x: torch.Tensor,
    dy,
    params: list[torch.Tensor],
    stepped: nn.Module | None = None,
) -> Callable:
    """One training step of `module`: output and the gradients of x and every parameter.

    `stepped`: a module whose Fp8Linear weights count as changed before every call, as after
    an optimizer step, so that their FP8 copies are re-made once per step as in training
    (the version counter moves; no kernel runs)."""
    leaves = [x, *params]
    weights = [m.weight for m in stepped.modules() if isinstance(m, Fp8Linear)] if stepped else []

    def run():
        if weights:
            torch._C._autograd._unsafe_set_version_counter(
                tuple(weights), tuple(w._version + 1 for w in weights)
            )
        return torch.autograd.grad(module(x), leaves, dy)

    return run


def error_of(module: Callable, x: torch.Tensor, reference: torch.Tensor) -> Callable[[], float]:
    """The relative error of `module`'s output against the bf16 path's."""
    return lambda: rel_err(module(x).detach(), reference)


def inference_fn(module: Callable, x: torch.Tensor) -> Callable:
    def run():
        with torch.no_grad():
            return module(x)

    return run


def data(M: int, K: int, N: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(M, K, device=DEVICE, generator=g, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=DEVICE, generator=g, dtype=torch.bfloat16) * 1e-2
    return x.requires_grad_(True), dy


def bf16_linear(K: int, N: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(K, N, device=DEVICE, dtype=torch.bfloat16)


def torchao_variants(linear: nn.Linear) -> dict[str, Callable[[bool], nn.Module]]:
    """torchao Float8Linear recipes (None when torchao is missing)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:
        return {}

    def make(recipe: str):
        def build(compiled: bool) -> nn.Module:
            module = nn.Sequential(_clone(linear))
            convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))
            return torch.compile(module) if compiled else module

        return build

    return {"tensorwise": make("tensorwise"), "rowwise": make("rowwise")}


def _clone(linear: nn.Linear) -> nn.Linear:
    new = nn.Linear(
        linear.in_features, linear.out_features, device=DEVICE, dtype=linear.weight.dtype
    )
    new.load_state_dict(linear.state_dict())
    return new


def our_configs() -> dict[str, Fp8LinearConfig]:
    """Fp8Linear candidates: every pass FP8 on each backend, and FP8 in some passes only."""
    configs = {}
    # triton.fp8 (no TMA) measured 0.6x cuBLAS on the H200 (kernels_quick): not a candidate.
    for backend in ("torch.scaled_mm", "triton.fp8.tma") if CUDA else ("triton.fp8",):
        short = backend.split(".", 1)[1]
        configs[f"row@{short}"] = Fp8LinearConfig.from_recipes(
            ROW, ROW, ROW, backend=backend, pad=True
        )
    configs["tensor e5m2-grads@scaled_mm"] = Fp8LinearConfig.from_recipes(
        TENSOR_FWD, TENSOR_GRAD, TENSOR_GRAD, backend="torch.scaled_mm", pad=True
    )
    configs["row fwd+dgrad@scaled_mm"] = Fp8LinearConfig(
        PassConfig(ROW, "torch.scaled_mm"), PassConfig(ROW, "torch.scaled_mm"), "bf16", pad=True
    )
    configs["row fwd@scaled_mm"] = Fp8LinearConfig(
        PassConfig(ROW, "torch.scaled_mm"), "bf16", "bf16", pad=True
    )
    if not CUDA:  # the interpreter runs the Triton backends only, and slowly
        return {k: configs[k] for k in ("row@fp8",)}
    return configs


# ---------------------------------------------------------------------------------- sections
def linear_section() -> None:
    for index, (shape, M, K, N) in enumerate(LINEAR_SHAPES[MODE]):
        compile_here = CUDA and not ARGS.no_compile and index < COMPILED_SHAPES
        x, dy = data(M, K, N, index)
        linear = bf16_linear(K, N, index)
        reference = linear(x).detach()
        base = dict(M=M, K=K, N=N, G=1, train=True)
        bf16 = record(
            "linear",
            shape,
            "bf16 nn.Linear",
            step_fn(linear, x, dy, list(linear.parameters())),
            impl="bf16",
            recipe="bf16",
            compiled=False,
            **base,
        )
        for name, config in our_configs().items():
            module = Fp8Linear.from_linear(_clone(linear), config)
            record(
                "linear",
                shape,
                f"ours {name}",
                step_fn(module, x, dy, list(module.parameters()), module),
                impl="ours",
                recipe=str(config),
                compiled=False,
                check=error_of(module, x, reference),
                **base,
            )
        if compile_here:
            torch._dynamo.reset()  # a fresh cache: no recompile limit reached across shapes
            module = Fp8Linear.from_linear(_clone(linear), our_configs()["row@scaled_mm"])
            compiled = torch.compile(module)
            record(
                "linear",
                shape,
                "ours row@scaled_mm (compiled)",
                step_fn(compiled, x, dy, list(module.parameters()), module),
                impl="ours",
                recipe="row",
                compiled=True,
                **base,
            )
        for recipe, build in torchao_variants(linear).items():
            for compiled in (False, True) if compile_here else (False,):
                if compiled:
                    torch._dynamo.reset()
                try:
                    module = build(compiled)
                except Exception as exc:  # recorded as an error row
                    record(
                        "linear",
                        shape,
                        f"torchao {recipe}",
                        _raise(exc),
                        impl="torchao",
                        recipe=recipe,
                        compiled=compiled,
                        **base,
                    )
                    continue
                suffix = " (compiled)" if compiled else ""
                record(
                    "linear",
                    shape,
                    f"torchao {recipe}{suffix}",
                    step_fn(module, x, dy, list(module.parameters())),
                    impl="torchao",
                    recipe=recipe,
                    compiled=compiled,
                    check=error_of(module, x, reference),
                    **base,
                )
        ratio_rows("linear", shape, bf16)


def ln_section() -> None:
    for index, (shape, M, K, N) in enumerate(LN_SHAPES[MODE]):
        x, dy = data(M, K, N, 100 + index)
        torch.manual_seed(index)
        norm = nn.LayerNorm(K, device=DEVICE, dtype=torch.bfloat16)
        linear = bf16_linear(K, N, index)
        bf16 = nn.Sequential(norm, linear)
        reference = bf16(x).detach()
        config = (
            Fp8LinearConfig.from_recipes(ROW, ROW, ROW)
            if not CUDA
            else Fp8LinearConfig.from_recipes(ROW, ROW, ROW, backend="torch.scaled_mm", pad=True)
        )
        unfused = nn.Sequential(_clone_norm(norm), Fp8Linear.from_linear(_clone(linear), config))
        fused = nn.Sequential(*fuse_pair(_clone_norm(norm), _clone(linear), config))
        paths = {
            "bf16 LayerNorm + nn.Linear": (bf16, "bf16"),
            "ours LayerNorm + Fp8Linear": (unfused, "ours"),
            "ours NormLinear (fused)": (fused, "ours"),
        }
        ao = torchao_variants(linear).get("rowwise")
        if ao is not None and CUDA and not ARGS.no_compile:
            try:
                inner = ao(False)
                paths["torchao rowwise (compiled)"] = (
                    torch.compile(nn.Sequential(_clone_norm(norm), inner)),
                    "torchao",
                )
            except Exception as exc:
                print(f"torchao LayerNorm path unavailable: {exc}")
        for train in (True, False):
            rows = {}
            for path, (module, impl) in paths.items():
                fn = (
                    step_fn(module, x, dy, list(module.parameters()), module)
                    if train
                    else inference_fn(module, x)
                )
                rows[path] = record(
                    "lnlinear",
                    shape,
                    path,
                    fn,
                    impl=impl,
                    recipe="row" if impl != "bf16" else "bf16",
                    compiled="compiled" in path,
                    train=train,
                    M=M,
                    K=K,
                    N=N,
                    G=1,
                    check=None if impl == "bf16" else error_of(module, x, reference),
                )
            ratio_rows("lnlinear", shape, rows["bf16 LayerNorm + nn.Linear"], train=train)


def _clone_norm(norm: nn.LayerNorm) -> nn.LayerNorm:
    new = nn.LayerNorm(norm.normalized_shape, device=DEVICE, dtype=norm.weight.dtype)
    new.load_state_dict(norm.state_dict())
    return new


class Projections(nn.Module):
    """The zoo's PerFeatureProjections: one small Linear per feature."""

    def __init__(self, G: int, K: int, N: int) -> None:
        super().__init__()
        self.projections = nn.ModuleList(
            nn.Linear(K, N, device=DEVICE, dtype=torch.bfloat16) for _ in range(G)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([p(x[:, i]) for i, p in enumerate(self.projections)], dim=1)


def grouped_section() -> None:
    for index, (shape, G, B, K, N) in enumerate(GROUP_SHAPES[MODE]):
        torch.manual_seed(index)
        loop = Projections(G, K, N)
        g = torch.Generator(device=DEVICE).manual_seed(200 + index)
        x = torch.randn(B, G, K, device=DEVICE, generator=g, dtype=torch.bfloat16).requires_grad_(
            True
        )
        dy = torch.randn(B, G, N, device=DEVICE, generator=g, dtype=torch.bfloat16) * 1e-2
        reference = loop(x).detach()
        fp8 = Fp8LinearConfig.from_recipes(ROW, ROW, ROW)
        paths = {
            "bf16 loop of nn.Linear": (loop, "bf16"),
            "ours GroupedLinear bmm": (GroupedLinear(loop, GroupLayout(), backend="bmm"), "ours"),
            "ours GroupedLinear fp8 row": (
                GroupedLinear(loop, GroupLayout(), backend="fp8", config=fp8),
                "ours",
            ),
            "ours GroupedLinear fp8 fwd, bmm bwd": (
                GroupedLinear(
                    loop, GroupLayout(), backend="fp8", config=Fp8LinearConfig(ROW, "bf16", "bf16")
                ),
                "ours",
            ),
        }
        rows = {}
        for path, (module, impl) in paths.items():
            rows[path] = record(
                "grouped",
                shape,
                path,
                step_fn(module, x, dy, list(module.parameters())),
                impl=impl,
                recipe="bf16" if "fp8" not in path else "row",
                compiled=False,
                train=True,
                M=B,
                K=K,
                N=N,
                G=G,
                check=None if impl == "bf16" else error_of(module, x, reference),
            )
        ratio_rows("grouped", shape, rows["bf16 loop of nn.Linear"])


def _raise(exc: Exception) -> Callable:
    def run():
        raise exc

    return run


def ratio_rows(section: str, shape: str, base: dict, train: bool = True) -> None:
    t0 = base.get("t_ms")
    for row in ROWS:
        if row["section"] == section and row["shape"] == shape and row.get("train", True) == train:
            t = row.get("t_ms")
            row["speedup_vs_bf16"] = t0 / t if t and t0 else math.nan


# ---------------------------------------------------------------------------------- summary
def summarize() -> dict:
    summary = {"linear": [], "lnlinear": [], "grouped": []}
    shapes = {(r["section"], r["shape"], r.get("train", True)) for r in ROWS}
    for section, shape, train in sorted(
        shapes, key=lambda s: [r["shape"] for r in ROWS].index(s[1])
    ):
        rows = [
            r
            for r in ROWS
            if (r["section"], r["shape"], r.get("train", True)) == (section, shape, train)
        ]
        timed = [r for r in rows if r.get("t_ms") and r["ok"]]
        bf16 = next((r for r in timed if r["impl"] == "bf16"), None)
        ours = min((r for r in timed if r["impl"] == "ours"), key=lambda r: r["t_ms"], default=None)
        ao = min(
            (r for r in timed if r["impl"] == "torchao"), key=lambda r: r["t_ms"], default=None
        )
        entry = {
            "shape": shape,
            "train": train,
            "M": rows[0]["M"],
            "K": rows[0]["K"],
            "N": rows[0]["N"],
            "G": rows[0]["G"],
            "bf16_ms": bf16 and bf16["t_ms"],
            "ours_best": ours and ours["path"],
            "ours_ms": ours and ours["t_ms"],
            "ours_vs_bf16": ours and bf16 and bf16["t_ms"] / ours["t_ms"],
            "torchao_best": ao and ao["path"],
            "torchao_ms": ao and ao["t_ms"],
            "torchao_vs_bf16": ao and bf16 and bf16["t_ms"] / ao["t_ms"],
            "ours_vs_torchao": ours and ao and ao["t_ms"] / ours["t_ms"],
        }
        summary[section].append(entry)
    return summary


def aims(summary: dict) -> dict:
    """The issue's aim: ahead of torchao at every shape where either beats bf16."""
    contested = [
        e
        for e in summary["linear"] + summary["lnlinear"]
        if e["ours_vs_bf16"]
        and e["torchao_vs_bf16"]
        and max(e["ours_vs_bf16"], e["torchao_vs_bf16"]) > 1
    ]
    met = [e for e in contested if e["ours_vs_torchao"] >= 1]
    return {
        "ahead_of_torchao_where_fp8_wins": {
            "shapes": len(contested),
            "met": len(met),
            "missed": [
                (e["shape"], e["train"], e["ours_vs_torchao"]) for e in contested if e not in met
            ],
        },
        "grouped_beats_loop": {e["shape"]: e["ours_vs_bf16"] for e in summary["grouped"]},
    }


def fmt(v, digits=2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def print_summary(summary: dict, aim: dict) -> None:
    device = torch.cuda.get_device_name() if CUDA else "CPU (interpreter: times mean nothing)"
    print(f"\n== loka-mods bench ({MODE}) on {device} ==")
    head = f"{'section':<13} {'shape':<22} {'M':>6} {'K':>5} {'N':>5} {'bf16 ms':>8} {'ours x':>7} {'ao x':>6} {'ours/ao':>7}  best ours / best torchao"
    print(head)
    for section in ("linear", "lnlinear", "grouped"):
        for e in summary[section]:
            tag = section if e["train"] else section + "(inf)"  # inference: forward only
            print(
                f"{tag:<13} {e['shape'][:22]:<22} {e['M']:>6} {e['K']:>5} {e['N']:>5} {fmt(e['bf16_ms'], 3):>8} "
                f"{fmt(e['ours_vs_bf16']):>7} {fmt(e['torchao_vs_bf16']):>6} {fmt(e['ours_vs_torchao']):>7}  "
                f"{e['ours_best'] or '-'} / {e['torchao_best'] or '-'}"
            )
    a = aim["ahead_of_torchao_where_fp8_wins"]
    print(
        f"aim ahead of torchao where either beats bf16: met at {a['met']}/{a['shapes']} shapes; missed {a['missed']}"
    )
    failed = [r for r in ROWS if not r["ok"]]
    print(f"rows: {len(ROWS)}; failed or skipped: {len(failed)}")
    for r in failed[:12]:
        print(
            f"  {r['section']} {r['shape']} {r['path']}: {r['error'] or 'rel_err ' + fmt(r.get('rel_err'), 4)}"
        )


def main(argv: list[str] | None = None) -> int:
    global ARGS, MODE, BUDGET
    ARGS = parse_args(argv)
    MODE = "smoke" if ARGS.smoke else "full"
    BUDGET = Budget(ARGS.budget_s)
    # Every compiled module of every shape recompiles the same forward code objects.
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    out = Path(ARGS.out)
    runners = {"linear": linear_section, "lnlinear": ln_section, "grouped": grouped_section}
    errors = {}
    sections = ARGS.sections.split(",")
    unknown = [s for s in sections if s not in runners]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {list(runners)}")
    for i, section in enumerate(sections):
        start_section(section, sections[i:])
        print(f"[{elapsed():6.1f} s] {section} (until {SECTION_DEADLINE[0]:.0f} s)", flush=True)
        try:
            runners[section]()
        except Exception as exc:
            traceback.print_exc()
            errors[section] = f"{type(exc).__name__}: {exc}"
    summary = summarize()
    aim = aims(summary)
    name = f"mods_{MODE}_{stamp()}"
    csv_path = write_csv(out / f"{name}.csv", ROWS, FIELDS)
    record = {
        "meta": metadata(DEVICE, mode=MODE, budget_s=ARGS.budget_s),
        "summary": summary,
        "aims": aim,
        "section_errors": errors,
        "wall_s": elapsed(),
    }
    write_json(out / f"{name}.json", record)
    print_summary(summary, aim)
    print(f"\nwrote {csv_path} and {csv_path.with_suffix('.json')} in {elapsed():.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
