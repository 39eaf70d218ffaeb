"""What one sampled step of Probe's analysis costs: aten ops and background-thread seconds.

On a GPU host the analysis is bound by host time per op (a sampled step of DHEN large is
tens of thousands of ops, about 1 s of the background thread on an H100), so the op count
is the figure to lower; it is the same on the CPU, where it is counted here with a
dispatch mode around the background thread's work. The zoo model trains a few steps with
Probe sampling every step (every site, the default recipes); the first sampled step warms
up, the next `--steps` are counted and timed.

    python bench/probe_ops.py --model dhen --preset large --batch-size 256

Run it on two trees (`PYTHONPATH` = another checkout's package sources) for an A/B.
On a GPU (`--device cuda`), `--error-graphs both` times the analysis with its CUDA graphs
(`ProbeConfig.error_graphs`) off and on in alternating blocks of one process; there the
ops are counted only with `--count` (counting costs host time of its own).
Results in --out: probe_ops_<utc>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from harness import metadata, parser, stamp, write_json


def variant_list(text: str) -> list[str]:
    """`--error-graphs`: 'on', 'off', 'on+host=0', ... comma-separated; 'both' = off,on."""
    variants = ["off", "on"] if text == "both" else text.split(",")
    for v in variants:
        graphs, _, host = v.partition("+host=")
        if graphs not in ("on", "off") or (host and not host.isdigit()):
            raise argparse.ArgumentTypeError(f"--error-graphs: unknown variant {v!r}")
    return variants


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import loka.zoo as zoo
    from loka.probe import Probe, ProbeConfig

    p = parser(__doc__)
    p.add_argument("--model", default="dhen")
    p.add_argument("--preset", default="large")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="sampled steps counted per block")
    p.add_argument("--rows", type=int, default=256, help="ProbeConfig.rows")
    p.add_argument("--device", default="cpu")
    p.add_argument("--error-graphs", default="off", type=variant_list,
                   help="variants timed in alternating blocks: ProbeConfig.error_graphs 'on' "
                   "or 'off', each with '+host=N' for host_error_max_size N; 'both' = off,on")  # fmt: skip
    p.add_argument("--blocks", type=int, default=2, help="blocks per variant with several")
    p.add_argument("--count", action="store_true", help="count aten ops on a GPU too")
    p.add_argument("--cprofile", action="store_true",
                   help="profile the background thread's Python (probe_ops_<utc>.pstats.txt)")  # fmt: skip
    args = p.parse_args(argv)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    device = torch.device(args.device)
    count = args.count or device.type == "cpu"
    setup = zoo.create(args.model, args.preset, device=device, seed=0, batch_size=args.batch_size)
    opt = zoo.make_optimizer(setup.model, zoo.OptimizerConfig(lr=1e-3))
    # two warm-up steps: a layout's first analysis runs eagerly, its second is captured
    batches = iter(setup.train_batches())
    variants = args.error_graphs * (args.blocks if len(args.error_graphs) > 1 else 1)
    rows, sites = [], 0
    profiler = cProfile.Profile() if args.cprofile else None
    for block, variant in enumerate(variants):
        graphs, _, host = variant.partition("+host=")
        sizes = {"host_error_max_size": int(host)} if host else {}
        config = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, rows=args.rows,
                             queue_size=args.steps + 4, timing=False,
                             error_graphs=graphs == "on", **sizes)  # fmt: skip
        probe = Probe(setup.model, config)
        for _ in range(2):  # caches, lazy setup and the graphs' captures: not counted
            zoo.training_step(setup, setup.model, opt, next(batches))
            probe.step()
        probe.flush()
        worker = probe._worker  # the background thread's job function, wrapped to count it
        process = worker._process

        def counted(job, variant=variant, block=block, process=process) -> None:
            before, start = Count.ops, time.perf_counter()
            if profiler is not None:
                profiler.enable()  # on the background thread, which runs this
            if count:
                with Count():
                    process(job)
            else:
                process(job)
            if profiler is not None:
                profiler.disable()
            rows.append({"variant": variant, "block": block,
                         "ops": Count.ops - before if count else None,
                         "seconds": time.perf_counter() - start})  # fmt: skip

        worker._process = counted
        for _ in range(args.steps):
            zoo.training_step(setup, setup.model, opt, next(batches))
            probe.step()
            probe.flush()
        counters = probe.counters
        rows[-1]["counters"] = {k: v for k, v in counters.items() if k.startswith("graph_")}
        sites = len(probe.tables()["sites"])
        probe.detach()
    meta = metadata(device, model=args.model, preset=args.preset, batch_size=args.batch_size,
                    rows=args.rows, sites=sites, threads=torch.get_num_threads())  # fmt: skip
    path = write_json(Path(args.out) / f"probe_ops_{stamp()}.json", {"meta": meta, "rows": rows})
    for r in rows:
        ops = f"{r['ops']} aten ops, " if r["ops"] is not None else ""
        print(f"[probe_ops] graphs {r['variant']}: {ops}{r['seconds']:.3f} s per sampled step")
    for variant in dict.fromkeys(r["variant"] for r in rows):
        seconds = sorted(r["seconds"] for r in rows if r["variant"] == variant)
        print(f"[probe_ops] graphs {variant}: median {seconds[len(seconds) // 2]:.3f} s "
              f"({seconds[0]:.3f}-{seconds[-1]:.3f}) over {len(seconds)} sampled steps")  # fmt: skip
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
        stats.print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        pstats_path = path.with_suffix(".pstats.txt")
        pstats_path.write_text(text.getvalue())
        print(f"wrote {pstats_path}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
