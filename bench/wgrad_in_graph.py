"""One MLP block, compiled, with and without FP8 wgrad: where a wgrad pass loses in the graph.

DHEN xl trained 1.137x bf16 with its plan and 0.970x once the seven `fc1` wgrad passes
were added (`bench/results/realized_20261203T115719Z`): each timed 0.341 vs 0.389 ms on
its own, ~0.65 ms slower each in place. A whole-model A/B takes minutes of compile per
variant; this script rebuilds the block those passes sit in (pre-norm, LayerNorm ->
fc1 -> GELU -> fc2, residual; DHEN xl: d 2048, hidden 4096, 16384 tokens, bf16 autocast,
`torch.native` FP8 as compiled plans run it) and times its forward + backward compiled,
seconds per variant:

- ``bf16``: both linears in high precision;
- ``plan``: fwd and dgrad of both in FP8 (e4m3, rowwise dynamic), wgrad bf16: the plan;
- ``plan+fc1.wgrad``, ``plan+fc2.wgrad``, ``plan+wgrad``: the plan with those wgrad passes
  in FP8 as well;
- ``plan+wgrad.tensor``: the plan with both wgrad passes in FP8 at tensor scales (one
  amax per operand instead of one per column over the tokens);
- ``plan+center``, ``plan+fc2.center``: the plan with both forwards, or fc2's, centered
  (``.../center``: the input's token mean taken out before quantizing and its product with
  the weight added back as the GEMM's bias): what the mean, its GEMV and the bias cost in
  the graph, where the standalone bench times them apart from the input's producer;
- ``fc1.wgrad``: that wgrad pass alone in FP8;
- ``triton``, ``triton+wgrad``: the plan, and the plan with both wgrad passes, on
  ``torch.scaled_mm`` instead: the same GEMMs, the operands quantized by our Triton kernels
  (`loka_mods` custom ops, opaque to inductor), x and dY each by one transpose-quantization
  that writes the row-scaled operand and its column-scaled transpose from two reads,
  instead of inductor's separate fused kernels.

Each is timed under each of `--inductor`'s setting sets (``default``; ``mk``: multi-kernel
reductions; ``cdt``: coordinate-descent tuning of every Triton kernel's block sizes and
warps; ``mk+cdt``), speedup against bf16 under the same settings; with `--profile` each
variant's kernels go into
`wgrad_in_graph_<stamp>_profiles/` (torch.profiler tables: compare with
`bench/profile_summary.py --diff`), so that the kernel that carries the loss can be named.
Results in --out: wgrad_in_graph_<utc>.json.

    python3 bench/wgrad_in_graph.py --profile
    python3 bench/wgrad_in_graph.py --tokens 16384 --dim 2048 --hidden 4096
On the CPU it runs tiny shapes in eager mode (`--compile off` implied): a check of the
script, not of any speed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from harness import Budget, metadata, parser, profile_events, stamp, time_ms, write_json

ROW = "e4m3:e4m3/row/dynamic"
TENSOR = "e4m3:e4m3/tensor/dynamic"
CENTER = "e4m3:e4m3/row/dynamic/center"
PLAN = ("fc1.fwd", "fc1.dgrad", "fc2.fwd", "fc2.dgrad")
# variant -> the passes in FP8, as "linear.pass"
VARIANTS = {
    "bf16": (),
    "plan": PLAN,
    "plan+fc1.wgrad": (*PLAN, "fc1.wgrad"),
    "plan+fc2.wgrad": (*PLAN, "fc2.wgrad"),
    "plan+wgrad": (*PLAN, "fc1.wgrad", "fc2.wgrad"),
    "plan+wgrad.tensor": (*PLAN, "fc1.wgrad:tensor", "fc2.wgrad:tensor"),
    "plan+center": ("fc1.fwd:center", "fc1.dgrad", "fc2.fwd:center", "fc2.dgrad"),
    "plan+fc2.center": ("fc1.fwd", "fc1.dgrad", "fc2.fwd:center", "fc2.dgrad"),
    "fc1.wgrad": ("fc1.wgrad",),
    "triton": PLAN,
    "triton+wgrad": (*PLAN, "fc1.wgrad", "fc2.wgrad"),
}
# the backend of a variant's FP8 passes
NATIVE, TRITON_QUANT = "torch.native", "torch.scaled_mm"


def backend_of(variant: str) -> str:
    return TRITON_QUANT if variant.startswith("triton") else NATIVE


# --inductor's setting sets: torch.compile(options=...)
INDUCTOR = {
    "default": {},
    "mk": {"triton.multi_kernel": 1},
    "cdt": {"coordinate_descent_tuning": True},
    "mk+cdt": {"triton.multi_kernel": 1, "coordinate_descent_tuning": True},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, budget_s=240.0)
    p.add_argument("--tokens", type=int, default=None, help="M (16384; CPU 64)")
    p.add_argument("--dim", type=int, default=None, help="d (2048; CPU 32)")
    p.add_argument("--hidden", type=int, default=None, help="fc1's width (4096; CPU 64)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--compile", choices=("on", "off"), default=None,
                   help="torch.compile the block (default: on with a GPU)")  # fmt: skip
    p.add_argument("--inductor", default="default,mk",
                   help=f"setting sets to time each variant under ({', '.join(INDUCTOR)})")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="a profiler table per variant")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    unknown = [v for v in args.inductor.split(",") if v not in INDUCTOR]
    if unknown:
        p.error(f"--inductor: unknown {', '.join(unknown)} (known: {', '.join(INDUCTOR)})")
    return args


def block(
    dim: int, hidden: int, fp8: tuple[str, ...], device: str, seed: int = 0, backend: str = NATIVE
):
    """The pre-norm MLP block with the named passes in FP8 (on `backend`, e4m3, rowwise;
    a pass named ``linear.pass:tensor`` at tensor scales, ``linear.pass:center`` centered)."""
    import torch
    from torch import nn

    from loka.mods import Fp8Linear, Fp8LinearConfig, PassConfig

    torch.manual_seed(seed)
    norm, fc1, fc2 = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def convert(linear: nn.Linear, name: str) -> nn.Module:
        def recipe(p: str) -> PassConfig | str:
            if f"{name}.{p}:tensor" in fp8:
                return PassConfig(TENSOR, backend)
            if f"{name}.{p}:center" in fp8:
                return PassConfig(CENTER, backend)
            return PassConfig(ROW, backend) if f"{name}.{p}" in fp8 else "bf16"

        passes = {p: recipe(p) for p in ("fwd", "dgrad", "wgrad")}
        if all(v == "bf16" for v in passes.values()):
            return linear
        return Fp8Linear.from_linear(linear, Fp8LinearConfig(**passes))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc1, self.fc2 = norm, convert(fc1, "fc1"), convert(fc2, "fc2")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))

    return Block().to(device)


def step_fn(model, x, device: str):
    """One forward + backward under bf16 autocast (parameter gradients set to None first)."""
    import torch

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()

    return step


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    tokens = args.tokens or (16384 if gpu else 64)
    dim, hidden = args.dim or (2048 if gpu else 32), args.hidden or (4096 if gpu else 64)
    compiled = (args.compile or ("on" if gpu else "off")) == "on"
    settings = args.inductor.split(",") if compiled else ["default"]
    budget, rows, skipped = Budget(args.budget_s), [], []
    when = stamp()
    profiles = Path(args.out) / f"wgrad_in_graph_{when}_profiles"
    x = torch.randn(tokens, dim, device=device, requires_grad=True)
    for setting in settings:
        base_ms = None
        for name in args.variants.split(","):
            if budget.over():
                skipped.append(f"{name} inductor={setting}")
                continue
            if not gpu and backend_of(name) != NATIVE:  # _scaled_mm is rowwise on CUDA only
                skipped.append(f"{name}: {backend_of(name)} needs a GPU")
                continue
            torch._dynamo.reset()
            model = block(dim, hidden, VARIANTS[name], device, backend=backend_of(name))
            run = model
            if compiled:
                run = torch.compile(model, options=dict(INDUCTOR[setting]))
            step = step_fn(run, x, device)
            ms = time_ms(step, device)
            base_ms = ms if name == "bf16" else base_ms
            row = {"variant": name, "fp8_passes": list(VARIANTS[name]), "ms": ms,
                   "backend": backend_of(name),
                   "inductor": setting, "compiled": compiled,
                   "speedup_vs_bf16": base_ms / ms if base_ms else None}  # fmt: skip
            if args.profile:
                table = profile_events(lambda i, step=step: step(), 4).table(
                    sort_by="cuda_time_total" if gpu else "cpu_time_total", row_limit=80,
                    max_name_column_width=160,
                )  # fmt: skip
                profiles.mkdir(parents=True, exist_ok=True)
                tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}_{setting}")
                (profiles / f"profile_{tag}.txt").write_text(table)
                row["profile"] = f"profile_{tag}.txt"
            rows.append(row)
            speedup = row["speedup_vs_bf16"]
            print(f"[wgrad_in_graph {budget.elapsed():5.0f} s] {name:16s} "
                  f"{setting:8s} {ms:8.3f} ms "
                  f"{'' if speedup is None else f'{speedup:.3f}x bf16'}", flush=True)  # fmt: skip
    meta = metadata(device, tokens=tokens, dim=dim, hidden=hidden, recipe=ROW,
                    skipped=skipped,
                    timing="fwd+bwd of the block, bf16 autocast, harness.time_ms (do_bench "
                           "median on CUDA)")  # fmt: skip
    path = write_json(Path(args.out) / f"wgrad_in_graph_{when}.json", {"meta": meta, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
