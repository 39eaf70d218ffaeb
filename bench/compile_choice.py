"""`choose_compile_options` on a zoo model's own training step: multi-kernel or not.

Builds a zoo model (bf16 autocast on a GPU, the zoo's optimizer), lets
`loka.dispatch.compile_options.choose_compile_options` compile it both ways and time
interleaved blocks of real training steps, and records the choice with the block medians.
No plan is applied: this exercises the chooser where a user calls it, before or after
`apply` (`bench/realized.py`'s `loka+mk` variant is the A/B for planned models).

    python3 bench/compile_choice.py --model dhen --preset large      # GPU
    python3 bench/compile_choice.py                                  # CPU: tiny, a smoke run
Results in --out: compile_choice_<utc>.json.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from harness import metadata, parser, stamp, write_json


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--model", default="dhen")
    p.add_argument("--preset", default=None, help="zoo preset (default: large on a GPU, tiny)")
    p.add_argument("--mode", default="default", help="torch.compile mode")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--steps-per-block", type=int, default=5)
    p.add_argument("--warmup-steps", type=int, default=3)
    args = p.parse_args(argv)

    import torch

    import loka.zoo as zoo
    from loka.dispatch.compile_options import choose_compile_options

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    preset = args.preset or ("large" if gpu else "tiny")
    setup = zoo.create(args.model, preset, device=device, seed=0)
    opt = zoo.make_optimizer(setup.model, zoo.OptimizerConfig(lr=1e-3, fused=gpu))
    batches = itertools.cycle([b for b, _ in zip(setup.train_batches(), range(8), strict=False)])
    autocast = torch.bfloat16 if gpu else None
    if args.mode == "reduce-overhead":
        mark = torch.compiler.cudagraph_mark_step_begin
    else:
        mark = lambda: None  # noqa: E731

    def train_step(run):
        mark()
        zoo.training_step(setup, run, opt, next(batches), autocast_dtype=autocast,
                          check_finite=False)  # fmt: skip

    begin = time.perf_counter()
    choice = choose_compile_options(
        setup.model, train_step, args.mode, blocks=args.blocks,
        steps_per_block=args.steps_per_block, warmup_steps=args.warmup_steps,
    )  # fmt: skip
    wall = time.perf_counter() - begin
    print(f"{args.model} ({preset}): {choice.line()} [{wall:.0f} s]", flush=True)
    result = {
        "meta": metadata(device, model=args.model, preset=preset, mode=args.mode),
        "multi_kernel": choice.multi_kernel,
        "options": choice.options,
        "speedup_multi_kernel": choice.speedup,
        "interval": [choice.low, choice.high],
        "confidence": choice.confidence,
        "block_median_ms": choice.step_ms,
        "wall_s": wall,
    }
    out = write_json(Path(args.out, f"compile_choice_{stamp()}.json"), result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
