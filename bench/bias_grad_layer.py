"""Where HSTU xl's uvqk backward spends its time: one HSTU layer, compiled, by bias-gradient form.

In HSTU xl's compiled step one kernel per layer takes 2.6 ms in bf16 and 3.4 ms in a LoKA
plan (`bench/results/realized_20261203T220217Z_profiles`): the gradient of uvqk's output
(SiLU backward of the four chunks, the jagged gathers) fused with the bias gradient, a
column sum over the token count M, which is symbolic for jagged batches, so inductor runs it
as one serial loop over M per column block. This script times one `loka.zoo` HSTU layer at
the xl preset's sizes (dim 3072, 12 heads, sequences of up to 256 items, 256 sequences:
~32k jagged tokens), compiled as the realized bench compiles it (`dynamic=None`: the second token count makes
M symbolic), forward + backward under bf16 autocast, with
its two linears as:

- ``bf16``: `nn.Linear` (autograd's own backward: the bf16 model's step);
- ``bf16+<form>``: the same GEMMs in an autograd function whose bias gradient is
  `loka.mods.bias_grad`'s form ``sum``, ``split`` or ``gemm``; ``bf16+nobias`` drops the
  biases (what the layer costs without any column sum: a floor);
- ``fp8+<form>``: `Fp8Linear` on the torch-native backend with the HSTU xl plan's recipes
  for the layers whose wgrad stays bf16 (fwd e4m3 tensor, dgrad e4m3 row), `tokens_vary`
  as `loka.dispatch.apply` sets it for jagged sites, bias gradient ``<form>``;
- ``fp8w+<form>``: the same with uvqk's wgrad in FP8 too (e5m2:e4m3 tensor), as the plan
  has it for three of the eight layers.

A variant may end in options: ``@mk`` compiles with multi-kernel reductions
(`triton.multi_kernel=1`, what `loka.dispatch.compile_options()` gives and the realized runs
use), ``@bf`` with `benchmark_fusion=True` (inductor times a fusion against its unfused
kernels and keeps the faster; with this layer's symbolic M inductor 2.11 raised
"unexpected group" while fusing, a377b48's run), e.g. ``fp8+sum@mk``.

Measured with a row-amax chunk (453e83e: a token row's amax over 1024-column chunks first,
``@rc<N>``; `bias_grad_layer_20261203T233414Z.json`): the FP8 layer ran 1.054x bf16 with it
and 1.076x without (multi-kernel), 1.049x / 1.069x without multi-kernel, 1.101x / 1.122x with
uvqk's wgrad in FP8: the chunked amax kernel (2.6 ms, the producer fused in) and a cast kernel
that recomputes the producer (1.2 ms) cost more than the one looped reduction (3.2 ms). The
option was removed again.

Blocks of `--steps` fwd+bwd calls per variant, interleaved over `--blocks` rounds, CUDA
events; the median block's ms per call, and each variant's kernels (torch.profiler, one
call) with the largest device time. The gradients of every ``bf16+<form>`` are checked
against ``bf16``'s. Results in --out: bias_grad_layer_<utc>.json.

    python3 bench/bias_grad_layer.py                      # H200: the xl layer
On the CPU it runs a tiny layer (a check of the script, not of any speed).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

from harness import Budget, device_kernels, metadata, parser, profile_events, stamp, write_json

FORMS = ("sum", "split", "gemm")
VARIANTS = (
    "bf16",
    *(f"bf16+{f}" for f in FORMS),
    "bf16+nobias",
    *(f"fp8+{f}" for f in FORMS),
    *(f"fp8w+{f}" for f in ("sum", "split")),
)


def parse_args(argv: list[str] | None = None) -> argparse.ArgumentParser:
    p = parser(__doc__, budget_s=300.0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=10, help="fwd+bwd calls per timed block")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--top", type=int, default=6, help="kernels recorded per variant")
    return p.parse_args(argv)


def layer_sizes(gpu: bool) -> dict:
    if gpu:
        return dict(dim=3072, heads=12, length=256, sequences=256)
    return dict(dim=64, heads=2, length=16, sequences=8)


def batches(sizes: dict, device, count: int = 4):
    """`count` jagged batches (x, grid) with different token counts (M is dynamic)."""
    import torch

    from loka.zoo.models.hstu import TokenGrid

    out = []
    g = torch.Generator().manual_seed(0)
    B, L, D = sizes["sequences"], sizes["length"], sizes["dim"]
    for _ in range(count):
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        T = int(offsets[-1])
        row = torch.repeat_interleave(torch.arange(B), lengths)
        position = torch.arange(T) - offsets[row]
        valid = torch.arange(L).view(1, -1) < lengths.view(-1, 1)
        grid = TokenGrid(B, L, (row * L + position).to(device), valid.to(device))
        x = torch.randn(T, D, generator=g).to(device).requires_grad_(True)
        out.append((x, grid))
    return out


def bias_form_linear(linear, form: str):
    """`linear` computing with its own Parameters through an autograd function whose bias
    gradient is `loka.mods.bias_grad`'s `form`: the bf16 GEMMs nn.Linear runs."""
    import torch
    import torch.nn.functional as F

    from loka.mods.bias_grad import bias_gradient

    class BiasForm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight)
            return F.linear(x, weight, bias)

        @staticmethod
        def backward(ctx, dy):
            x, weight = ctx.saved_tensors
            dx = dy @ weight.to(dy.dtype)
            dw = (dy.t() @ x.to(dy.dtype)).to(weight.dtype)
            return dx, dw, bias_gradient(dy, form).to(weight.dtype)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = linear

        def forward(self, x):
            dtype = torch.get_autocast_dtype(x.device.type)
            with torch.autocast(x.device.type, enabled=False):
                x = x.to(dtype)
                w, b = self.inner.weight.to(dtype), self.inner.bias.to(dtype)
                return BiasForm.apply(x, w, b)

    return Wrapped()


INDUCTOR_SUFFIXES = {"mk": {"triton.multi_kernel": 1}, "bf": {"benchmark_fusion": True}}


def split_variant(variant: str) -> tuple[str, dict]:
    """(the linears' variant, the inductor options its suffixes ask for)."""
    name, *suffixes = variant.split("@")
    unknown = [s for s in suffixes if s not in INDUCTOR_SUFFIXES]
    if name not in VARIANTS or unknown:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}, each "
                         f"optionally with @{', @'.join(INDUCTOR_SUFFIXES)}")  # fmt: skip
    options: dict = {}
    for suffix in suffixes:
        options.update(INDUCTOR_SUFFIXES[suffix])
    return name, options


def build(variant: str, base, device):
    """A copy of the layer `base` with its linears as `variant` says."""
    from torch import nn

    from loka.mods import Fp8Linear, Fp8LinearConfig

    layer = copy.deepcopy(base)
    kind, _, form = variant.partition("+")
    if kind == "bf16" and form == "nobias":
        for name in ("uvqk", "out"):
            old = getattr(layer, name)
            new = nn.Linear(old.in_features, old.out_features, bias=False, device=device)
            new.weight = old.weight
            setattr(layer, name, new)
    elif kind == "bf16" and form:
        layer.uvqk = bias_form_linear(layer.uvqk, form)
        layer.out = bias_form_linear(layer.out, form)
    elif kind in ("fp8", "fp8w"):
        backend = "torch.native" if device.type == "cuda" else "torch.native.cpu"
        for name in ("uvqk", "out"):
            wgrad = "e5m2:e4m3/tensor/dynamic" if kind == "fp8w" and name == "uvqk" else "bf16"
            config = Fp8LinearConfig.from_recipes(
                "e4m3:e4m3/tensor/dynamic", "e4m3:e4m3/row/dynamic", wgrad, backend=backend
            ).replace(bias_grad=form, tokens_vary=True)
            setattr(layer, name, Fp8Linear.from_linear(getattr(layer, name), config))
    return layer


def main(argv: list[str] | None = None) -> int:
    import torch

    from loka.zoo.models.hstu import HSTUConfig, HSTULayer

    args = parse_args(argv)
    budget = Budget(args.budget_s)
    # Every variant compiles the same HSTULayer.forward (a static graph, then a dynamic one):
    # dynamo counts them all against one code object's limit.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Variants share graphs (a forward the row-amax chunk does not touch): a cache hit of a
    # multi-kernel graph crashed inductor 2.11 on reload (`bias_grad_layer_rc.log`).
    torch._inductor.config.fx_graph_cache = False
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    sizes = layer_sizes(gpu)
    torch.manual_seed(0)
    config = HSTUConfig(
        num_items=10, max_seq_len=sizes["length"], embedding_dim=sizes["dim"],
        num_heads=sizes["heads"], num_layers=1,
    )  # fmt: skip
    base = HSTULayer(config).to(device)
    data = batches(sizes, device)
    variants = [v for v in args.variants.split(",") if v]
    try:
        parsed = {v: split_variant(v) for v in variants}
    except ValueError as exc:
        print(f"bias_grad_layer: {exc}")
        return 2
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step_fn(layer, options):
        compiled = torch.compile(layer, dynamic=None, options=options or None)

        def step(i: int, keep_grads: bool = False) -> dict | None:
            x, grid = data[i % len(data)]
            with autocast:
                out = compiled(x, grid)
            out.float().square().mean().backward()
            kept = None
            if keep_grads:
                kept = {n: p.grad.float().clone() for n, p in layer.named_parameters()
                        if p.grad is not None}  # fmt: skip
            layer.zero_grad(set_to_none=True)
            x.grad = None
            return kept

        return step

    layers, steps, rows, grads = {}, {}, [], {}
    for variant in variants:
        if budget.over(60):
            rows.append({"variant": variant, "skipped": "budget"})
            continue
        name, options = parsed[variant]
        if options and not gpu:
            options = {k: v for k, v in options.items() if not k.startswith("triton.")}
        layers[variant] = build(name, base, device)
        steps[variant] = step_fn(layers[variant], options)
        for i in range(3):  # compile: the first M static, then a dynamic graph
            steps[variant](i)
        grads[variant] = steps[variant](0, keep_grads=True)  # checked against bf16's below
        print(f"{variant}: compiled ({budget.elapsed():.0f} s)", flush=True)

    timed = {v: [] for v in steps}
    for block in range(args.blocks):
        for variant, step in steps.items():
            if gpu:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
            else:
                t0 = time.perf_counter()
            for i in range(args.steps):
                step(block * args.steps + i)
            if gpu:
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end) / args.steps
            else:
                ms = 1e3 * (time.perf_counter() - t0) / args.steps
            timed[variant].append(ms)
    base_ms = statistics.median(timed["bf16"]) if "bf16" in timed else None
    for variant, blocks in timed.items():
        events = device_kernels(profile_events(steps[variant], 1)) if gpu else []
        top = sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]
        ms = statistics.median(blocks)
        row = {
            "variant": variant, "ms": ms, "blocks_ms": blocks,
            "vs_bf16": base_ms / ms if base_ms else None,
            "kernels": [{"name": e.key[:200], "ms": e.self_device_time_total / 1e3,
                         "calls": e.count} for e in top],
        }  # fmt: skip
        if parsed[variant][0] != "bf16+nobias" and variant != "bf16" and "bf16" in grads:
            ref = grads["bf16"]
            row["grad_rel_err"] = max(
                ((grads[variant][n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item()
                for n in ref if n in grads[variant]
            )  # fmt: skip
        rows.append(row)
        err = f"  grad rel err {row['grad_rel_err']:.1e}" if "grad_rel_err" in row else ""
        ratio = f" ({row['vs_bf16']:.3f}x bf16)" if row["vs_bf16"] else ""
        print(f"{variant:14s} {ms:8.3f} ms{ratio}  blocks {[round(b, 3) for b in blocks]}{err}")
        for k in row["kernels"]:
            print(f"    {k['ms']:8.3f} ms  x{k['calls']:<3d} {k['name'][:110]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bias_grad_layer_{stamp()}.json"
    write_json(path, {"metadata": metadata(device, sizes=sizes, tokens=[int(x.shape[0])
               for x, _ in data], steps=args.steps, blocks=args.blocks), "rows": rows})  # fmt: skip
    print(f"wrote {path} in {budget.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
