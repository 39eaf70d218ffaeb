"""What one sampled step of Probe's analysis costs: aten ops and background-thread seconds.

On a GPU host the analysis is bound by host time per op (a sampled step of DHEN large is
tens of thousands of ops, about 1 s of the background thread on an H100), so the op count
is the figure to lower; it is the same on the CPU, where it is counted here with a
dispatch mode around the background thread's work. The zoo model trains a few steps with
Probe sampling every step (every site, the default recipes); the first sampled step warms
up, the next `--steps` are counted and timed.

    python bench/probe_ops.py --model dhen --preset large --batch-size 256

Run it on two trees (`PYTHONPATH` = another checkout's package sources) for an A/B.
Results in --out: probe_ops_<utc>.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from harness import metadata, parser, stamp, write_json


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import loka.zoo as zoo
    from loka.probe import Probe, ProbeConfig

    p = parser(__doc__)
    p.add_argument("--model", default="dhen")
    p.add_argument("--preset", default="large")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="sampled steps counted")
    args = p.parse_args(argv)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    setup = zoo.create(args.model, args.preset, device="cpu", seed=0, batch_size=args.batch_size)
    opt = zoo.make_optimizer(setup.model, zoo.OptimizerConfig(lr=1e-3))
    batches = [b for b, _ in zip(setup.train_batches(), range(args.steps + 1), strict=False)]
    config = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None,
                         queue_size=args.steps + 2, timing=False)  # fmt: skip
    probe = Probe(setup.model, config)
    zoo.training_step(setup, setup.model, opt, batches[0])
    probe.step()
    probe.flush()  # the first sampled step: caches and lazy setup, not counted
    worker = probe._worker  # the background thread's job function, wrapped to count it
    process, rows = worker._process, []

    def counted(job) -> None:
        before, start = Count.ops, time.perf_counter()
        with Count():
            process(job)
        rows.append({"ops": Count.ops - before, "seconds": time.perf_counter() - start})

    worker._process = counted
    for batch in batches[1:]:
        zoo.training_step(setup, setup.model, opt, batch)
        probe.step()
        probe.flush()
    probe.detach()
    meta = metadata("cpu", model=args.model, preset=args.preset, batch_size=args.batch_size,
                    sites=len(probe.tables()["sites"]), threads=torch.get_num_threads())  # fmt: skip
    path = write_json(Path(args.out) / f"probe_ops_{stamp()}.json", {"meta": meta, "rows": rows})
    for r in rows:
        print(f"[probe_ops] {r['ops']} aten ops, {r['seconds']:.2f} s per sampled step")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
