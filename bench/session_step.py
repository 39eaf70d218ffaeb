"""A Session dropped into a compiled trainer, against the same trainer without it.

What a user sees: a zoo model compiled with `compile_options()` and trained with the zoo's
optimizer, once through `Session(compiled, SessionConfig(...))` (warm-up with Probe, the
plan, verification in place, the guard), and once plain. After the Session has applied
and verified its plan, both models train on in interleaved blocks (the same batches,
cycled; CUDA events; the order rotating) and the planned step's speedup over the plain
compiled bf16 step is reported beside what the Session predicted and verified. The plain
twin starts from the same weights; its steps during the Session's warm-up are not timed.

    python bench/session_step.py --model dhen --preset xl --warmup-steps 100
    python bench/session_step.py --device cpu --preset tiny   # smoke test (no timing worth)

Results in --out: session_step_<utc>.json (the events, the plan's summary, block times).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from harness import Budget, metadata, parser, stamp, write_json
from realized import Clock, block_stats, interleaved


def main(argv: list[str] | None = None) -> int:
    import torch

    import loka.zoo as zoo
    from loka.dispatch import Session, SessionConfig, compile_options

    p = parser(__doc__, budget_s=540)
    p.add_argument("--model", default="dhen")
    p.add_argument("--preset", default="xl")
    p.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--decide-steps", type=int, default=None, help="SessionConfig.decide_steps")
    p.add_argument("--max-steps", type=int, default=2000, help="stop the Session phase here")
    p.add_argument("--kernel-bench", default=None, help="kernel_bench parquet to plan from")
    p.add_argument("--bench-budget-s", type=float, default=60.0)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--block-steps", type=int, default=8)
    p.add_argument("--batches", type=int, default=4, help="pre-generated batches, cycled")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend ('eager' for a quick smoke test)")  # fmt: skip
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    autocast = torch.bfloat16 if gpu else None

    def log(text: str) -> None:
        print(f"[session_step {budget.elapsed():6.0f} s] {text}", flush=True)

    def trainer(seed_model):
        setup = zoo.create(args.model, args.preset, device=device, seed=0)
        if seed_model is not None:
            setup.model.load_state_dict(seed_model.state_dict())
        opt = zoo.make_optimizer(setup.model, zoo.OptimizerConfig(lr=1e-3))
        # compile_options' inductor settings are for a GPU (Triton); on the CPU plain.
        options = compile_options() if gpu and args.backend == "inductor" else None
        run = torch.compile(setup.model, backend=args.backend, options=options)
        return setup, opt, run

    from torch._dynamo.utils import counters

    def dynamo_now() -> dict[str, int]:
        return {
            "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"].get("unique_graphs", 0),
        }

    counters.clear()
    setup, opt, run = trainer(None)
    plain_setup, plain_opt, plain_run = trainer(setup.model)
    batches = [b for b, _ in zip(setup.train_batches(), range(args.batches), strict=False)]
    events: list[str] = []
    config = SessionConfig(warmup_steps=args.warmup_steps, decide_steps=args.decide_steps,
                           kernel_bench=args.kernel_bench, bench_budget_s=args.bench_budget_s)  # fmt: skip
    session = Session(run, config, sample=batches[0], on_event=events.append)

    def step(which: str, i: int) -> None:
        s, o, r = (setup, opt, run) if which == "session" else (plain_setup, plain_opt, plain_run)
        loss = zoo.training_step(s, r, o, batches[i % len(batches)], autocast_dtype=autocast,
                                 check_finite=False)  # fmt: skip
        if which == "session":
            session.step(loss)

    steps = 0
    while session.phase in ("warmup", "verifying") and steps < args.max_steps:
        step("session", steps)
        steps += 1
    log(f"session phase {session.phase!r} after {steps} steps")
    for text in events:
        log(f"  {text}")
    # Dynamo during the Session's phase (a model compiled under Probe's hooks broke its
    # graph at every site, for good), then while both models train on
    session_phase = dynamo_now()
    counters.clear()
    clock = Clock(device)
    for which in ("plain", "session"):  # compile and warm up both before timing
        for i in range(3):
            step(which, i)
    clock.sync()
    times = interleaved(
        {"plain": lambda i: step("plain", i), "session": lambda i: step("session", i)},
        args.blocks, args.block_steps, clock, budget.left,
    )  # fmt: skip
    stats = block_stats(times["plain"], times["session"])
    summary = session.plan.summary if session.plan is not None else None
    result = {
        "steps_in_session_phase": steps,
        "phase": session.phase,
        "events": events,
        "block_ms": times,
        "plain_ms": statistics.median(times["plain"]),
        "session_ms": statistics.median(times["session"]),
        **stats,
        "sites_fp8": summary.sites_fp8 if summary else 0,
        "predicted_speedup": summary.predicted_speedup if summary else None,
        "predicted_from_step": summary.predicted_from_step if summary else None,
        "verified_speedup": summary.measured_speedup if summary else None,
        "verified_interval": summary.measured_interval if summary else None,
        "summary": summary.lines() if summary else [],
        "dynamo_session_phase": session_phase,
        "dynamo_after": dynamo_now(),
    }
    log(f"plain compiled bf16 {result['plain_ms']:.2f} ms, session {result['session_ms']:.2f}"
        f" ms: {stats['speedup_vs_bf16']:.3f}x [{stats['ratio_min']:.3f}, "
        f"{stats['ratio_max']:.3f}]")  # fmt: skip
    meta = metadata(device, model=args.model, preset=args.preset,
                    warmup_steps=args.warmup_steps, blocks=args.blocks,
                    block_steps=args.block_steps)  # fmt: skip
    path = write_json(Path(args.out) / f"session_step_{stamp()}.json",
                      {"meta": meta, "result": result})  # fmt: skip
    session.close()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
