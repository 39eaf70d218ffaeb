"""The demo: a zoo model trained on its data, LoKA's way.

1. bf16 warm-up with Probe attached (every GEMM site's numerics under each FP8 recipe);
2. plan: kernel times measured on this GPU (cached), or, on a machine without one,
   ESTIMATED for the H200 from the shipped table;
3. apply the plan in place and continue training (the same optimizer); on a GPU the
   session first verifies the plan on the real step (planned against bf16, sites demoted
   until it is not slower; `loka.dispatch.verify`), and those steps come on top of `steps`;
4. print the plan and the speedup (measured step times on a GPU; the planner's estimate on
   the CPU), evaluate before and after, and write the HTML report.

    loka demo                      # CPU: dhen tiny, ~1 minute; GPU: dhen large, measured
    loka demo --model wukong --warmup-steps 40 --steps 40 --out demo-out
    loka demo --compile            # torch.compile the model, as trainers do: a compiled plan
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loka.dispatch.compile_options import compile_options
from loka.dispatch.console import (
    console,
    plan_lines,
    print_lines,
    print_plan,
    progress_bar,
    wrap_lines,
)
from loka.dispatch.integrations.session import Session, SessionConfig, warmup_probe_config
from loka.dispatch.planner import Plan


@dataclass
class DemoResult:
    plan: Plan
    out: Path
    device: str
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    losses: list[float]
    bf16_step_ms: float | None = None  # measured, GPU only
    plan_step_ms: float | None = None
    events: list[str] = field(default_factory=list)
    compiled: bool = False  # its warm-up ran eagerly: the speedup is verification's

    @property
    def measured_speedup(self) -> float | None:
        if self.bf16_step_ms and self.plan_step_ms:
            return self.bf16_step_ms / self.plan_step_ms
        return None


def run_demo(
    model: str = "dhen",
    preset: str | None = None,
    *,
    warmup_steps: int | None = None,
    steps: int | None = None,
    device: str | None = None,
    out: str | os.PathLike[str] = "loka-demo",
    seed: int = 0,
    kernel_bench=None,
    bench_budget_s: float | None = 60.0,
    quiet: bool = False,
    verbose: bool = False,
    compile: bool = False,
) -> DemoResult:
    """Run the demo; see the module documentation. Defaults: on a GPU the `large` preset,
    200 warm-up and 100 further steps; on the CPU `tiny`, 20 and 20. The plan prints one
    line per FP8 site in 80 columns; `verbose` adds its full table. `compile` trains the
    `torch.compile`d model (the session then plans for compiled execution)."""
    import loka.zoo as zoo

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.device(device).type == "cuda"
    preset = preset or ("large" if gpu else "tiny")
    warmup_steps = warmup_steps or (200 if gpu else 20)
    steps = steps if steps is not None else (100 if gpu else 20)
    out = Path(out)
    say = (lambda *a: None) if quiet else console.print

    setup = zoo.create(model, preset, device=device, seed=seed)
    say(f"[bold]LoKA demo[/]: {model} ({preset}) on {device}, "
        f"{sum(p.numel() for p in setup.model.parameters()):,} parameters")  # fmt: skip
    eval_batches = setup.eval_batches()
    setup.model.eval()
    with torch.no_grad():
        before = setup.metrics(setup.model, eval_batches)
    setup.model.train()
    # Probe samples every warm-up step on short runs; on long ones (GPU) one step in
    # warmup_steps // 10, and the unsampled steps time the bf16 baseline.
    probe = warmup_probe_config(warmup_steps)
    # On a GPU the warm-up may run on to decide the verdicts that hold the plan back
    # (`decide_steps`); the CPU demo stays short (its kernel times are estimates anyway).
    config = SessionConfig(
        warmup_steps=warmup_steps, probe=probe, out_dir=out, kernel_bench=kernel_bench,
        bench_budget_s=bench_budget_s, decide_steps=None if gpu else 0,
    )  # fmt: skip
    sample = next(setup.train_batches())
    run = torch.compile(setup.model, options=compile_options()) if compile else setup.model
    session = Session(run, config, sample=sample)
    # The zoo's optimizer, as the preset trains: AdamW, with row-wise Adagrad on tables that
    # take sparse gradients (the xl presets' default; AdamW alone refuses those).
    optimizer = zoo.make_optimizer(setup.model, zoo.OptimizerConfig(lr=1e-3))
    autocast = torch.bfloat16 if gpu else None
    losses, times = [], []
    batches = setup.train_batches()
    total, i = warmup_steps + steps, 0
    with progress_bar("training", total) as update:
        while i < total:
            if session.phase == "verifying" or (session.phase == "warmup" and i >= warmup_steps):
                total += 1  # verification and deciding steps do not count as planned steps
            batch = next(batches)
            sampled = session.phase == "warmup" and probe.is_sampled(i)
            start = time.perf_counter()
            if gpu:
                torch.cuda.synchronize()
            loss = zoo.training_step(setup, run, optimizer, batch,
                                     autocast_dtype=autocast, check_finite=False)  # fmt: skip
            if gpu:
                torch.cuda.synchronize()
            times.append((session.phase, sampled, (time.perf_counter() - start) * 1e3))
            session.step(loss)
            losses.append(float(loss))
            phase = {"warmup": "bf16 + Probe", "verifying": "verifying"}.get(
                session.phase, "planned"
            )
            i += 1
            update(i, total, detail=f"{phase} loss {losses[-1]:.4f}")
    session.close()
    setup.model.eval()
    with torch.no_grad():
        after = setup.metrics(setup.model, eval_batches)
    result = DemoResult(session.plan, out, device, before, after, losses, events=session.events,
                        compiled=compile)  # fmt: skip
    # A compiled model's warm-up runs eagerly (Probe's hooks would break its graph for good):
    # its bf16 steps are no baseline for the compiled plan; verification times both compiled.
    if gpu and not compile:
        bf16 = [t for phase, sampled, t in times[5:] if phase == "warmup" and not sampled]
        planned = [t for phase, _, t in times if phase == "applied"][5:]
        result.bf16_step_ms = statistics.median(bf16) if bf16 else None
        result.plan_step_ms = statistics.median(planned) if planned else None
    if not quiet:
        _print(result, session, verbose=verbose)
    return result


def _print(result: DemoResult, session: Session, *, verbose: bool = False) -> None:
    plan = result.plan
    fp8 = plan.table.filter(plan.table["recipe"] != "bf16")
    if verbose and fp8.height:
        print_plan(plan.table, only_fp8=True)
    if fp8.height:
        print_lines(plan_lines(plan.table))
    else:
        why = (
            "FP8 verdicts were still undecided when the warm-up ended (see below)"
            if plan.summary.undecided
            else "at these shapes no safe FP8 candidate beats bf16"
        )
        console.print(
            f"[yellow]The plan keeps every site in bf16[/]: {why} (each site's reasons are "
            "in the report)."
        )
    print_lines(wrap_lines(plan.summary.lines(), prefix="  "))
    if result.compiled and result.device != "cpu":
        measured = plan.summary.measured_speedup
        console.print(
            "[bold]measured training step[/]: "
            + (
                f"{measured:.3f}x, verification's (bf16 and planned steps interleaved, both "
                "compiled; the warm-up ran eagerly while Probe watched)"
                if measured is not None
                else "not measured (nothing in FP8 to verify; the warm-up ran eagerly while "
                "Probe watched, so its steps are no compiled baseline)"
            )
        )
    elif result.measured_speedup is not None:
        console.print(
            f"[bold]measured training step[/]: bf16 {result.bf16_step_ms:.2f} ms -> planned "
            f"{result.plan_step_ms:.2f} ms = {result.measured_speedup:.3f}x"
        )
    else:
        console.print(
            "[bold yellow]no GPU here: the speedup above is ESTIMATED for "
            f"{plan.summary.device} from the shipped table, not measured[/]"
        )
    for key in result.metrics_before:
        console.print(
            f"  eval {key}: {result.metrics_before[key]:.4f} before, "
            f"{result.metrics_after[key]:.4f} after {len(result.losses)} steps"
        )
    for event in session.events:  # the guard's (verification's are in the summary above)
        if event.startswith("step ") and ("demoted" in event or "non-finite" in event):
            console.print(f"  guard: {event}")
    console.print(f"report: {result.out / 'report.html'}; tables and plan in {result.out}/")
