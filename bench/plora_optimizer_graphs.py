"""PLoRA's optimizer step as a CUDA graph (`PerAdapterOptimizer(graphs=...)`): the same
training, and how much host time it saves.

On bench/plora.py's model (Llama-style, ~0.7B, LoRA on all seven linears) with its first
`--jobs` jobs packed: two identical packs train `--steps` steps on the same batches, one with
the step's device work replayed from a CUDA graph and one issued op by op; rows record the
largest difference of any adapter parameter and of the reported gradient norms between the
two (exact equality expected: the same kernels run), then the host and wall milliseconds of
`optimizer.step` alone (after a backward, gradients in place; median of `--reps`, graphs
and eager interleaved). With `--ab-blocks B`, then whole packed training steps (forward,
backward, optimizer) of one pack, the optimizer's graphs switched on and off between blocks
of `--block-steps` steps (ABBA order, B blocks each), for the eager and the compiled loss
(`--ab-loss`): per-block wall ms per step, medians, and each pair's ratio. Results:
plora_optimizer_graphs_<utc>.json.

    python3 bench/plora_optimizer_graphs.py              # 32 jobs, on the GPU
    python3 bench/plora_optimizer_graphs.py --ab-blocks 4  # + the real step, graphs on/off
On the CPU it runs the smoke model through a stand-in capture (a check of the script).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from harness import load, metadata, parser, stamp, write_json


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--jobs", type=int, default=None, help="jobs packed (32; CPU 2)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--ab-blocks", type=int, default=0, help="blocks per mode (0: no A/B)")
    p.add_argument("--block-steps", type=int, default=6)
    p.add_argument("--ab-loss", choices=("eager", "compiled", "both"), default="both")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    bench = load("plora")
    bench.configure(bench.parse_args([] if gpu else ["--smoke"]))
    from loka.plora import PackedLoraConfig, PerAdapterOptimizer, convert_to_packed_lora
    from loka.plora.runner import packed_train_step

    n = args.jobs or (32 if gpu else 2)
    jobs = bench.make_jobs(n)
    model = bench.build_model()
    capture = None if gpu else _stand_in_capture
    norms: list[list[list[float]]] = [[], []]
    finals, stats, host, wall = [], [], [], []
    for k, graphs in enumerate((True, False)):
        # The model is shared: each pack is converted, trained, timed and taken out in turn.
        packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="triton"))
        opt = PerAdapterOptimizer(packed, graphs=graphs, capture=capture)
        for step in range(args.steps):
            _, reports = packed_train_step(packed, opt, bench.token_batches(jobs, seed=step))
            norms[k].append([r.grad_norm for r in reports])
        finals.append([[t.detach().clone() for t in packed.adapter_parameters(i)]
                       for i in range(n)])  # fmt: skip
        h, w = _time_steps(packed, opt, jobs, bench, args.reps, gpu)
        host.append(h)
        wall.append(w)
        stats.append(dict(opt.graph_stats))
        packed.remove()
    param_diff = max(float((a - b).abs().max()) for ja, jb in zip(*finals, strict=True)
                     for a, b in zip(ja, jb, strict=True))  # fmt: skip
    norm_diff = max(abs(a - b) for sa, sb in zip(*norms, strict=True)
                    for a, b in zip(sa, sb, strict=True))  # fmt: skip
    row = {"jobs": n, "steps": args.steps, "max_param_diff": param_diff,
           "max_grad_norm_diff": norm_diff, "graph_stats": stats[0],
           "step_host_ms": {"graphs": host[0], "eager": host[1]},
           "step_wall_ms": {"graphs": wall[0], "eager": wall[1]}}  # fmt: skip
    print(f"[plora_optimizer_graphs] {row}", flush=True)
    result = {"meta": metadata("cuda" if gpu else "cpu"), "rows": [row]}
    if args.ab_blocks:
        losses = {"eager": (False,), "compiled": (True,), "both": (False, True)}[args.ab_loss]
        result["ab"] = [
            _ab_real_step(model, jobs, bench, args, capture, compiled) for compiled in losses
        ]
    path = Path(args.out) / f"plora_optimizer_graphs_{stamp()}.json"
    write_json(path, result)
    print(f"wrote {path}")
    return 0


def _ab_real_step(model, jobs, bench, args, capture, compiled: bool) -> dict:
    """Whole packed training steps with the optimizer's graphs on and off, interleaved in
    ABBA blocks on one pack (the same batches in both): wall ms per step of each block."""
    import torch

    from loka.plora import PackedLoraConfig, PerAdapterOptimizer, convert_to_packed_lora
    from loka.plora.runner import compiled_loss, packed_train_step, token_losses

    gpu = torch.cuda.is_available()
    loss_fn = token_losses
    if compiled:
        torch._dynamo.reset()
        loss_fn = compiled_loss(backend="inductor" if gpu else "aot_eager")
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="triton"))
    opt = PerAdapterOptimizer(packed, graphs=True, capture=capture)
    batches = [bench.token_batches(jobs, seed=s) for s in range(args.block_steps)]

    def block() -> float:
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in batches:
            packed_train_step(packed, opt, b, loss_fn=loss_fn)
        if gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / len(batches)

    # Warm-up: compile, the optimizer's first (op by op) step and its capture, both modes.
    warm = []
    for graphs in (True, False, True):
        opt.graphs = graphs
        warm.append(block())
    times: dict[str, list[float]] = {"graphs": [], "eager": []}
    order = [True, False, False, True] * ((args.ab_blocks + 1) // 2)
    for graphs in order[: 2 * args.ab_blocks]:
        opt.graphs = graphs
        times["graphs" if graphs else "eager"].append(block())
    stats = dict(opt.graph_stats)
    packed.remove()
    pairs = [e / g for g, e in zip(times["graphs"], times["eager"], strict=True)]
    row = {
        "loss": "compiled" if compiled else "eager", "jobs": len(jobs),
        "block_steps": args.block_steps, "warmup_ms": warm, "step_ms": times,
        "median_ms": {k: statistics.median(v) for k, v in times.items()},
        "eager_over_graphs": pairs, "eager_over_graphs_median": statistics.median(pairs),
        "graph_stats": stats,
    }  # fmt: skip
    print(f"[plora_optimizer_graphs ab] {row}", flush=True)
    return row


def _time_steps(packed, opt, jobs, bench, reps: int, gpu: bool) -> tuple[float, float]:
    """Median host and wall ms of `opt.step()` after a backward (gradients in place)."""
    import torch

    from loka.plora.runner import token_losses

    batches = bench.token_batches(jobs, seed=99)
    host, wall = [], []
    for _ in range(reps):
        # A backward without the step: packed_train_step's forward and loss, by hand.
        ids = torch.cat([b for _, b in batches]).to(packed.device)
        packed.set_batch([i for i, b in batches for _ in range(b.shape[0])], ids.shape[1] - 1)
        token_losses(packed.model, ids[:, :-1], ids[:, 1:], {}).mean().backward()
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        if gpu:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return statistics.median(host), statistics.median(wall)


class _StepGraph:
    def __init__(self, fn) -> None:
        self.fn, self.out = fn, None

    def replay(self) -> None:
        norms = self.fn()
        self.out.resize_(norms.shape).copy_(norms)


def _stand_in_capture(fn):
    import torch

    graph = _StepGraph(fn)
    graph.out = torch.empty(0)
    return graph, graph.out


if __name__ == "__main__":
    sys.exit(main())
