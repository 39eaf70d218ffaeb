"""Would 1x128 blockwise FP8 make the weight gradient pay where rowwise cannot?

The weight-gradient passes are the largest FP8 gap left in the xl plans: InterFormer xl's
interaction layers keep all 8 wgrad passes in bf16 (10.0 of 48.2 ms of its bf16 GEMM time)
because rowwise FP8 is both inaccurate there (error bounds 0.29-0.46 against a budget of
0.09: one scale per channel over 16384 tokens) and slow once its transposed quantizations
are paid (fc2: 1.305 against 1.261 ms). A scale per 128 tokens (1x128 blocks along the
reduction, DeepSeek-V3's wgrad recipe) bounds an outlier token's damage to its block;
torch 2.11's `torch.nn.functional.scaled_mm` runs it on the H200 (`BlockWise1x128` on both
operands, cuBLASLt). No backend of ours does yet. Before building one, this measures both
halves of the question on the model's own shapes and batches:

1. accuracy: Probe on the zoo model with the blockwise recipe added to dgrad and wgrad
   (`e4m3:e4m3/block/dynamic`: 1x128 blocks on activations and gradients, 128x128 on
   weights), the error bound of every site and pass per recipe, and the sites whose
   rowwise wgrad is over its budget while the blockwise one is within it; Probe samples
   `--rows` tokens of a batch, so one more step keeps the whole batch's x and dY of the
   `--capture` sites and gives the exact wgrad error of each way (plain relative error
   against float32, on the model's own operands);
2. speed (GPU only): for each distinct wgrad shape (``dW[N, K] = dY^T x`` over M tokens),
   the bf16 GEMM, the rowwise FP8 GEMM and the 1x128 x 1x128 FP8 GEMM on operands
   quantized beforehand, and the quantizations each FP8 GEMM needs from the row-major
   dY and x (transposed, in torch ops, compiled as a compiled step would run them).

Results in --out: blockwise_wgrad_<utc>.json.

Answered on the H200 (`bench/results/blockwise_wgrad_20261205T021130Z`, InterFormer xl,
B = 16384): no pass needs blocks to be accurate (the whole batch's rowwise wgrad errors are
0.015-0.024 against the 0.09 budget), and blocks do not pay: N=6912 K=4096 bf16 1.139 ms,
rowwise 0.717 + 0.429 of quantization, blockwise 0.999 + 0.691. No blockwise backend is
built. The 0.29-0.46 bounds that asked the question were Probe's balanced statistic, which
reads 0.34-0.43 on the whole batch too for `interaction.fc1` (its plain error is ~0.01);
at the other sites the sampled statistic overstated the whole batch's by up to 2.4x, fixed
in Probe since (`row_balanced_*` in this script's output compares the three readings).

    python3 bench/blockwise_wgrad.py --model interformer --preset xl --batch-size 4096
    python3 bench/blockwise_wgrad.py --model dhen --preset tiny --steps 4   # on a CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import Budget, key_values, metadata, parser, stamp, time_ms, write_json

BLOCK = "e4m3:e4m3/block/dynamic"
ROW = "e4m3:e4m3/row/dynamic"
TENSOR = "e4m3:e4m3/tensor/dynamic"
TILE = 128  # tokens per scale of a 1x128 block along the reduction


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, budget_s=420.0)
    p.add_argument("--model", default="interformer")
    p.add_argument("--preset", default="xl")
    p.add_argument("--batch-size", type=int, default=None,
                   help="training batch for the probe (default: the preset's)")  # fmt: skip
    p.add_argument("--steps", type=int, default=12, help="probed training steps")
    p.add_argument("--train-steps", type=int, default=0,
                   help="unprobed training steps first (a trained model's gradients)")  # fmt: skip
    p.add_argument("--rows", type=int, default=1024,
                   help="token rows Probe samples per GEMM call (the wgrad error's M)")  # fmt: skip
    p.add_argument("--tokens", type=int, default=16384,
                   help="M of the timed wgrad GEMMs (the preset's training batch)")  # fmt: skip
    p.add_argument("--capture", default="auto",
                   help="fnmatch pattern of the linears whose whole-batch wgrad operands are "
                        "captured for the exact row vs block error; auto: the 8 with the most "
                        "wgrad FLOPs (every site's x and dY of an xl batch would not fit)")  # fmt: skip
    p.add_argument("--zoo", default="",
                   help="zoo config overrides, e.g. 'max_table_rows=200000,num_items=100000' "
                        "(an xl preset's tables on a CPU: the dense sites are the preset's)")  # fmt: skip
    p.add_argument("--device", default=None)
    return p.parse_args(argv)


def probe_recipes() -> dict[str, tuple[str, ...]]:
    """Probe's defaults with the blockwise recipe in every pass (fwd has it already)."""
    from loka.probe import DEFAULT_RECIPES

    recipes = {p: tuple(r) for p, r in DEFAULT_RECIPES.items()}
    for pass_ in ("dgrad", "wgrad"):
        if BLOCK not in recipes[pass_]:
            recipes[pass_] = (*recipes[pass_], BLOCK)
    return recipes


def error_rows(site_errors, budgets: dict[str, float]) -> list[dict]:
    """One row per site and backward pass: each recipe's error bound (ucb) and whether it
    is within the pass's budget."""
    out: dict[tuple[str, str], dict] = {}
    for r in site_errors.iter_rows(named=True):
        if r["pass"] == "fwd":
            continue
        row = out.setdefault((r["site"], r["pass"]), {"site": r["site"], "pass": r["pass"],
                                                      "budget": budgets[r["pass"]]})  # fmt: skip
        row[r["recipe"]] = r["ucb_rel_err"]
    return sorted(out.values(), key=lambda row: (row["pass"], row["site"]))


def rescued(rows: list[dict]) -> list[str]:
    """``site/pass`` where no rowwise or tensorwise recipe is within budget and the
    blockwise one is."""
    names = []
    for row in rows:
        others = [v for k, v in row.items() if "/" in k and k != BLOCK and v is not None]
        block = row.get(BLOCK)
        if block is not None and block <= row["budget"] and all(v > row["budget"] for v in others):
            names.append(f"{row['site']}/{row['pass']}")
    return names


def quantize_1x128_transposed(t, scale_layout: bool = True):
    """`t` ``[M, C]`` (row-major tokens) as its transpose ``[C, M]`` in e4m3 with one scale
    per 128 tokens: (data ``[C, M]`` row-major, inverse scales ``[C, M / 128]`` with stride
    ``[1, C]``, the layout `scaled_mm`'s 1x128 operands take). The scales and the cast are
    the schema's (`loka.schema.fp8`, the recipes' definition), over a reshape that leaves
    each block's amax a local reduction. M must be a multiple of 128."""
    from loka.schema.fp8 import finite_abs, saturate_cast, scale_from_amax

    M, C = t.shape
    if M % TILE:
        raise ValueError(f"1x128 blocks along M need M % {TILE} == 0, got M = {M}")
    blocks = t.t().reshape(C, M // TILE, TILE)
    scale = scale_from_amax(finite_abs(blocks).amax(dim=-1), "e4m3", finite=True)
    data = saturate_cast(blocks, scale[..., None], "e4m3")
    inverse = scale.reciprocal()
    if scale_layout:
        inverse = inverse.t().contiguous().t()
    # The transposed view's blocks keep its strides through the elementwise ops: the GEMM
    # needs the data row-major.
    return data.reshape(C, M).contiguous(), inverse


def quantize_rowwise_transposed(t):
    """`t` ``[M, C]`` as its transpose ``[C, M]`` in e4m3 with one scale per row of the
    transpose (a channel over all M tokens), as `torch.native`'s wgrad quantizes it:
    (data, inverse scales ``[C, 1]``)."""
    from loka.kernels.native import quantize_native

    return quantize_native(t, "e4m3", "row", transpose=True)


def wgrad_blockwise(dy_t, dy_inv, x_t, x_inv):
    """``dY^T x`` [N, K] from the 1x128-quantized transposes (`quantize_1x128_transposed`
    of dY [M, N] and x [M, K])."""
    import torch
    import torch.nn.functional as F
    from torch.nn.functional import ScalingType

    return F.scaled_mm(dy_t, x_t.t(), dy_inv, ScalingType.BlockWise1x128, x_inv,
                       ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)  # fmt: skip


def wgrad_rowwise(dy_t, dy_inv, x_t, x_inv):
    """``dY^T x`` from the rowwise-quantized transposes (`quantize_rowwise_transposed`)."""
    import torch

    return torch._scaled_mm(dy_t, x_t.t(), dy_inv, x_inv.t(), out_dtype=torch.bfloat16)


def wgrad_reference(dy_t, dy_inv, x_t, x_inv):
    """The blockwise product dequantized in float32: what `wgrad_blockwise` computes, on
    any device (the CPU has no FP8 GEMM)."""
    C_dy, M = dy_t.shape
    dy = (dy_t.float().reshape(C_dy, M // TILE, TILE) * dy_inv[..., None]).reshape(C_dy, M)
    C_x = x_t.shape[0]
    x = (x_t.float().reshape(C_x, M // TILE, TILE) * x_inv[..., None]).reshape(C_x, M)
    return dy @ x.t()


def wgrad_shapes(sites, tokens: int) -> list[tuple[int, int, int]]:
    """Distinct (N, K, M) of the linear sites' weight gradients, M = `tokens`."""
    return sorted({(int(r["N"]), int(r["K"]), tokens) for r in sites.iter_rows(named=True)
                   if r["kind"] == "linear"})  # fmt: skip


def time_shape(N: int, K: int, M: int, device) -> dict:
    """GPU milliseconds of the wgrad GEMM of one shape: bf16, rowwise FP8, blockwise FP8 (on
    operands quantized beforehand), and each FP8 way's two transposed quantizations of the
    row-major dY and x (compiled). The FP8 GEMMs take N and K padded to multiples of 16 (an
    FP8 GEMM's rule; zero features are exact), as `torch.native` pads them."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    out: dict = {"N": N, "K": K, "M": M}
    out["bf16_ms"] = time_ms(lambda: dy.t() @ x, device)
    dy, x = F.pad(dy, (0, (-N) % 16)), F.pad(x, (0, (-K) % 16))
    row_q = torch.compile(lambda a, b: (quantize_rowwise_transposed(a),
                                        quantize_rowwise_transposed(b)))  # fmt: skip
    block_q = torch.compile(lambda a, b: (quantize_1x128_transposed(a),
                                          quantize_1x128_transposed(b)))  # fmt: skip
    for name, quantize, gemm in (("row", row_q, wgrad_rowwise),
                                 ("block", block_q, wgrad_blockwise)):  # fmt: skip
        try:
            (dq, di), (xq, xi) = quantize(dy, x)
            out[f"{name}_ms"] = time_ms(lambda g=gemm, a=(dq, di, xq, xi): g(*a), device)
            out[f"{name}_quantize_ms"] = time_ms(lambda q=quantize: q(dy, x), device)
            if name == "block":
                got = gemm(dq, di, xq, xi).float()
                want = dy.float().t() @ x.float()
                out["block_rel_err"] = float((got - want).norm() / want.norm())
        except Exception as e:  # a shape or layout cuBLASLt refuses: said in the row
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
    for name in ("row", "block"):
        if f"{name}_ms" in out:
            total = out[f"{name}_ms"] + out[f"{name}_quantize_ms"]
            out[f"{name}_speedup"] = out["bf16_ms"] / out[f"{name}_ms"]
            out[f"{name}_speedup_with_quantize"] = out["bf16_ms"] / total
    return out


def probe_errors(args, device: str) -> tuple[list[dict], dict]:
    import torch

    import loka.zoo as zoo
    from loka.probe import DEFAULT_BUDGETS, Probe, ProbeConfig

    kw = key_values(args.zoo)
    if args.batch_size:
        kw["batch_size"] = args.batch_size
    setup = zoo.create(args.model, args.preset, device=device, **kw)
    config = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, queue_size=10,
                         recipes=probe_recipes(), rows=args.rows)  # fmt: skip
    autocast = torch.bfloat16 if device == "cuda" else None
    if args.train_steps:
        zoo.train(setup, args.train_steps, autocast_dtype=autocast)
    with Probe(setup.model, config) as probe:
        zoo.train(setup, args.steps, on_step=lambda step, loss: probe.step(),
                  autocast_dtype=autocast)  # fmt: skip
        tables = probe.tables()
    rows = error_rows(tables["site_errors"], dict(DEFAULT_BUDGETS))
    names = capture_names(tables["sites"], args.capture)
    full = full_batch_errors(setup, names, autocast, args.rows)
    return rows, {"sites": tables["sites"], "full_batch": full}


def capture_names(sites, pattern: str, top: int = 8) -> list[str]:
    """The linear sites `--capture` names: those matching `pattern` (fnmatch), or for
    "auto" the `top` with the most wgrad work (K x N x M)."""
    import fnmatch

    linear = [r for r in sites.iter_rows(named=True) if r["kind"] == "linear"]
    if pattern != "auto":
        return [r["site"] for r in linear if fnmatch.fnmatch(r["site"], pattern)]
    linear.sort(key=lambda r: (-r["K"] * r["N"] * r["M_p50"], r["site"]))
    return [r["site"] for r in linear[:top]]


def capture_operands(setup, names: list[str], autocast) -> dict[str, tuple]:
    """One more training step of `setup` with the input x and the output gradient dY of
    the linears `names` kept, both 2-D ``[M, features]``: the wgrad operands of the whole
    batch, where Probe samples `--rows` of them."""
    import torch

    import loka.zoo as zoo

    captured: dict[str, list] = {}
    hooks = []

    def keep(name):
        def hook(module, inputs, output):
            captured[name] = [inputs[0].detach().reshape(-1, module.in_features), None]
            if output.requires_grad:

                def grad(g, name=name):
                    captured[name][1] = g.detach().reshape(-1, module.out_features)

                output.register_hook(grad)

        return hook

    wanted = set(names)
    for name, module in setup.model.named_modules():
        if isinstance(module, torch.nn.Linear) and name in wanted:
            hooks.append(module.register_forward_hook(keep(name)))
    try:
        zoo.train(setup, 1, autocast_dtype=autocast)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: (x, dy) for name, (x, dy) in captured.items() if dy is not None}


def wgrad_errors(x, dy, rows: int | None = None) -> dict[str, float]:
    """Relative error of ``dY^T x`` over the whole batch, quantized rowwise (a scale per
    channel over all M tokens) and 1x128 blockwise (a scale per 128 tokens), against
    float32; M is zero-padded to a multiple of 128 (exact: a zero token adds nothing).

    With `rows`, also Probe's own statistic (the balanced error, `loka.probe.gemm_error`) of
    the rowwise wgrad three ways: on the whole batch (`row_balanced`), on a sample of `rows`
    tokens as the sample's own GEMM (`row_balanced_sample`, what Probe read before it
    extrapolated), and estimated for the whole batch from that sample
    (`row_balanced_estimate`, what Probe reads now)."""
    import torch.nn.functional as F

    M = x.shape[0]
    out: dict[str, float] = {"M": int(M)}
    if rows:
        out.update(probe_statistics(x, dy, rows))
    pad = (-M) % TILE
    x, dy = F.pad(x.float(), (0, 0, 0, pad)), F.pad(dy.float(), (0, 0, 0, pad))
    want = dy.t() @ x
    norm = want.norm()
    rq, ri = quantize_rowwise_transposed(dy)
    rx, rxi = quantize_rowwise_transposed(x)
    row = (rq.float() * ri) @ (rx.float() * rxi).t()
    bq, bi = quantize_1x128_transposed(dy, scale_layout=False)
    bx, bxi = quantize_1x128_transposed(x, scale_layout=False)
    block = wgrad_reference(bq, bi, bx, bxi)
    return {**out, "row": float((row - want).norm() / norm),
            "block": float((block - want).norm() / norm)}  # fmt: skip


def probe_statistics(x, dy, rows: int) -> dict[str, float]:
    """`wgrad_errors`' three readings of Probe's balanced rowwise wgrad error."""
    import torch

    from loka.probe.gemm_error import PassOperands, pass_error_sums, relative_errors
    from loka.schema import Recipe

    M = x.shape[0]
    recipe = [Recipe.parse(ROW)]
    amaxes = dict(a_amax=dy.abs().amax(), b_amax=x.abs().amax(),
                  a_row_amax=dy.abs().amax(dim=0), b_row_amax=x.abs().amax(dim=0))  # fmt: skip

    def balanced(keep, m_total) -> float:
        d, v = (dy, x) if keep is None else (dy[keep], x[keep])
        ops = PassOperands(d.T, v.T, False, False, m_total=m_total, **amaxes)
        sums, _ = pass_error_sums(ops, recipe, out_dtype=dy.dtype)
        return float(relative_errors(sums)[0][1])

    g = torch.Generator(device=x.device).manual_seed(0)
    keep = torch.randperm(M, generator=g, device=x.device)[: min(rows, M)].sort().values
    return {"row_balanced": balanced(None, None), "row_balanced_sample": balanced(keep, None),
            "row_balanced_estimate": balanced(keep, M), "rows": int(keep.numel())}  # fmt: skip


def full_batch_errors(setup, names: list[str], autocast, rows: int | None = None) -> list[dict]:
    """`wgrad_errors` of every captured site (`capture_operands`), one at a time."""
    out = []
    for name, (x, dy) in capture_operands(setup, names, autocast).items():
        out.append({"site": name, **wgrad_errors(x, dy, rows)})
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    budget = Budget(args.budget_s)
    rows, tables = probe_errors(args, device)
    saved = rescued(rows)
    print(f"[blockwise_wgrad] {len(rows)} backward site passes probed; blockwise within budget "
          f"where no rowwise or tensorwise recipe is: {len(saved)}", flush=True)  # fmt: skip
    for name in saved:
        print(f"  {name}")
    for r in tables["full_batch"]:
        print(f"[blockwise_wgrad] {r['site']}: whole-batch wgrad error (M = {r['M']}) "
              f"rowwise {r['row']:.4f}, blockwise {r['block']:.4f}; Probe's balanced "
              f"rowwise: whole batch {r['row_balanced']:.4f}, {r['rows']}-token sample "
              f"{r['row_balanced_sample']:.4f}, estimated from it "
              f"{r['row_balanced_estimate']:.4f}", flush=True)  # fmt: skip
    timings = []
    if device == "cuda":
        for N, K, M in wgrad_shapes(tables["sites"], args.tokens):
            if budget.over():
                timings.append({"N": N, "K": K, "M": M, "skipped": "over the time budget"})
                continue
            t = time_shape(N, K, M, device)
            timings.append(t)
            print(f"[blockwise_wgrad] N={N} K={K} M={M}: bf16 {t['bf16_ms']:.3f} ms, "
                  + ", ".join(f"{n} {t[f'{n}_ms']:.3f} (+q {t[f'{n}_quantize_ms']:.3f})"
                              for n in ("row", "block") if f"{n}_ms" in t), flush=True)  # fmt: skip
    else:
        print("[blockwise_wgrad] no GPU: accuracy only (the CPU has no FP8 GEMM to time)")
    path = Path(args.out) / f"blockwise_wgrad_{stamp()}.json"
    meta = metadata(device, model=args.model, preset=args.preset, steps=args.steps,
                    train_steps=args.train_steps,
                    rows=args.rows, tokens=args.tokens, batch_size=args.batch_size,
                    zoo_overrides=key_values(args.zoo))  # fmt: skip
    write_json(path, {"meta": meta, "errors": rows, "rescued": saved,
                      "full_batch": tables["full_batch"], "timings": timings})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
