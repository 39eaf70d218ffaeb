"""InterFormer's attention over short sequences: which implementation a compiled step should run.

InterFormer xl's compiled bf16 training step spent 25 of its 124 ms in cuDNN's fused
attention (`bench/results/realized_20261203T220217Z_profiles`: 9 calls a step, 1.07 ms
forward and 1.70 ms backward each) for sequences of 18 tokens (2 CLS + 16 items), 2 heads of
128: a few GFLOP, where a fused kernel's tiles are mostly padding. That time is why its
linears are only ~41% of the step (issue 15 asks for 50%). This script times, compiled,
forward + backward under bf16 autocast, the two modules of the model that attend:

- `SequenceBlock` (PFFN, then self-attention over the sequence with its qkv and out
  projections) and `PoolingAttention` (PMA: learned queries over the sequence),
- each with `InterFormerConfig(attention="sdpa")` (torch's choice of fused kernel, and each
  SDPA backend forced in turn: cuDNN, memory-efficient, math) and `attention="math"` (plain
  ops, fused by inductor around two batched matmuls),

variants interleaved over `--rounds`, the median of each. The modules' linears are the same
in every variant, so the differences are the attention's.

    python3 bench/short_attention.py                 # InterFormer xl's shapes, on the GPU
    python3 bench/short_attention.py --batch 4096    # a smaller batch

On the CPU (no GPU) it runs InterFormer tiny's shapes eagerly: a check of the script.
Results in --out: short_attention_<utc>.json.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import traceback
from pathlib import Path

from harness import Budget, metadata, parser, stamp, time_ms, write_json

# torch's SDPA backends, forced one at a time (flash attention takes no mask: not listed).
SDPA_BACKENDS = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def parse_args(argv: list[str] | None = None):
    p = parser(__doc__, budget_s=420.0)
    p.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    p.add_argument("--batch", type=int, default=None, help="examples (default: the preset's)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every variant")
    return p.parse_args(argv)


def variants() -> list[tuple[str, str, str | None]]:
    """(name, `InterFormerConfig.attention`, forced SDPA backend or None)."""
    return [("sdpa", "sdpa", None),
            *((f"sdpa-{b.lower()}", "sdpa", b) for b in SDPA_BACKENDS),
            ("math", "math", None)]  # fmt: skip


def inputs(config, batch: int, device, seed: int = 0) -> dict:
    """A sequence arm's tensors as the model builds them: `seq [B, CLS + L, d]` with the
    left padding zeroed, `valid` (CLS always valid, 1..L items), `x_sum [B, n_sum, d]`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = config.num_cls + config.max_seq_len
    lengths = torch.randint(1, config.max_seq_len + 1, (batch,), generator=g)
    position = torch.arange(config.max_seq_len)
    present = position >= (config.max_seq_len - lengths).unsqueeze(1)
    valid = torch.cat([torch.ones(batch, config.num_cls, dtype=torch.bool), present], 1)
    seq = torch.randn(batch, tokens, config.embedding_dim, generator=g) * valid.unsqueeze(-1)
    x_sum = torch.randn(batch, config.num_summary, config.embedding_dim, generator=g)
    return {"seq": seq.to(device), "valid": valid.to(device), "x_sum": x_sum.to(device)}


def module_step(module, name: str, data: dict, autocast, backend: str | None, compiled: bool):
    """One forward + backward of `module` (its parameters' gradients set to None first),
    under autocast and with `backend` the only SDPA backend allowed."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if compiled and backend:
        # The forcing inside the compiled function: one compiled around the module would be
        # traced once, under whichever backend the first call allowed, and serve every
        # variant (dynamo does not guard on `sdpa_kernel`; a module instance of the same
        # class reuses the graph). A closure over the backend gets a graph of its own.
        only = [getattr(SDPBackend, backend)]

        def attend(*inputs):
            with sdpa_kernel(only):
                return module(*inputs)

        run = torch.compile(attend)
    else:
        run = torch.compile(module) if compiled else module
    seq = data["seq"].detach().requires_grad_()
    args = (seq, data["x_sum"], data["valid"]) if name == "sequence" else (seq, data["valid"])
    device = seq.device.type

    def step():
        module.zero_grad(set_to_none=True)
        forced = (
            sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext()
        )
        with forced, torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = run(*args)
        out.float().square().mean().backward()

    return step


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    import loka.zoo as zoo
    from loka.zoo.models.interformer import PoolingAttention, SequenceBlock

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    preset = "xl" if gpu else "tiny"
    base, _, preset_batch = zoo.preset_config("interformer", preset)
    batch = args.batch or preset_batch
    budget = Budget(args.budget_s)
    data = inputs(base, batch, device)
    made = {}
    for name, attention, backend in variants():
        torch.manual_seed(0)  # the same weights in every variant
        config = dataclasses.replace(base, attention=attention)
        for part, cls in (("sequence", SequenceBlock), ("pooling", PoolingAttention)):
            module = cls(config).to(device)
            made[(name, part)] = (module, backend)
    rows, steps = [], {}
    for (name, part), (module, backend) in made.items():
        row = {"variant": name, "module": part, "backend": backend, "batch": batch}
        try:
            step = module_step(module, part, data, gpu, backend, compiled=gpu)
            step()  # compile, and check that it runs
            steps[(name, part)] = step
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
            print(traceback.format_exc()[-2000:], file=sys.stderr)
        rows.append(row)
    times: dict = {key: [] for key in steps}
    for _ in range(args.rounds):
        for key, step in steps.items():
            if budget.over():
                break
            times[key].append(time_ms(step, device))
    for row in rows:
        key = (row["variant"], row["module"])
        if times.get(key):
            row["ms"] = statistics.median(times[key])
            row["rounds_ms"] = times[key]
    sdpa_ms = {r["module"]: r["ms"] for r in rows if r["variant"] == "sdpa" and "ms" in r}
    for r in rows:
        if r["module"] in sdpa_ms and "ms" in r:
            r["speedup_vs_sdpa"] = sdpa_ms[r["module"]] / r["ms"]
    meta = metadata(device, preset=preset, command=" ".join([sys.executable, *sys.argv]),
                    timing="fwd+bwd under bf16 autocast (GPU), compiled (GPU); median of "
                           "interleaved rounds, each a do_bench median")  # fmt: skip
    path = Path(args.out) / f"short_attention_{stamp()}.json"
    write_json(path, {"meta": meta, "rows": rows})
    for r in rows:
        what = f"{r['ms']:8.3f} ms" if "ms" in r else r.get("error", "not timed")[:90]
        ratio = f"  {r['speedup_vs_sdpa']:.2f}x sdpa" if "speedup_vs_sdpa" in r else ""
        print(f"{r['module']:<9} {r['variant']:<26} {what}{ratio}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
