"""Step-time overhead of loka.probe at its default schedule, side by side in one run.

Two identical copies of a zoo model (default: DHEN `large`, the anchor's DHEN-style model;
bf16 autocast, AdamW, eager) train on identical data streams in alternating blocks of
steps (A B B A A B ...: drift cancels): copy A with `Probe(model, ProbeConfig())`
attached, copy B without. Both copies are warmed up before the probe is attached, so the
probe's dense early sampling is inside the measurement. Every step syncs (the zoo's
finiteness check), so per-step wall times are exact.

Reported:
- overhead = sum(A step times) / sum(B step times) - 1 over all measured steps; A's
  background work is drained (probe.flush) before each B block so it cannot slow B, and
  the drain time is reported too ("overhead incl. drain" counts it all against A: an
  upper bound);
- the cost of one sampled step (its time minus B's median step) and of the step before it
  (amax tracking for delayed scaling); the side-stream device time per sampled step;
- the probe's own counters (dropped steps, background-thread time) and its tables, written
  next to the JSON (probe_overhead_<mode>_<time>_tables/).

    python bench/probe_overhead.py --smoke   # CPU, DHEN tiny, well under a minute
    python bench/probe_overhead.py           # GPU, DHEN large, 2 x 500 steps, ~2-3 min

Results: probe_overhead_<mode>_<utc time>.json (metadata, per-step times, summary) in --out
(default $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from pathlib import Path

import torch
from harness import key_values, metadata, write_json

import loka.zoo as zoo
from loka.probe import Probe, ProbeConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU")
    p.add_argument("--model", default="dhen")
    p.add_argument("--preset", default="large")
    p.add_argument("--steps", type=int, default=600, help="measured steps per copy")
    p.add_argument("--block", type=int, default=50, help="steps per alternating block")
    p.add_argument("--warmup", type=int, default=30, help="steps per copy before attaching")
    p.add_argument(
        "--config", default="",
        help="ProbeConfig overrides, e.g. 'every=50,rows=128' (default: ProbeConfig())",
    )  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if args.smoke:
        args.preset, args.steps, args.block, args.warmup = "tiny", 30, 10, 2
    return args


def run_metadata(args: argparse.Namespace, device: torch.device) -> dict:
    return metadata(device, args=vars(args))


class Copy:
    """One model copy with its optimizer and data stream."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.setup = zoo.create(args.model, args.preset, device=device, seed=0)
        self.optimizer = torch.optim.AdamW(self.setup.model.parameters(), lr=1e-3)
        self.batches = self.setup.train_batches()
        self.autocast = torch.bfloat16 if device.type == "cuda" else None
        self.times: list[float] = []

    def step(self) -> float:
        batch = next(self.batches)
        start = time.perf_counter()
        zoo.training_step(
            self.setup, self.setup.model, self.optimizer, batch, autocast_dtype=self.autocast
        )  # syncs: the finiteness check reads the loss
        return (time.perf_counter() - start) * 1e3


def parse_overrides(text: str) -> dict:
    """'every=50,rows=128,host_error_max_size=0' -> ProbeConfig keyword arguments;
    'drop_pow2=1' keeps the default recipes without their power-of-two-scale variants."""
    out = key_values(text)
    if out.pop("drop_pow2", 0):
        defaults = ProbeConfig().recipes
        out["recipes"] = {p: tuple(r for r in rs if "/pow2" not in r) for p, rs in defaults.items()}
    return out


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    meta = run_metadata(args, device)
    copies = {"probe": Copy(args, device), "plain": Copy(args, device)}
    for copy in copies.values():
        copy.setup.model.train()
        for _ in range(args.warmup):
            copy.step()
    config = ProbeConfig(**parse_overrides(args.config))
    probe = Probe(copies["probe"].setup.model, config)
    sampled, before_sampled, drain_ms = [], [], 0.0
    probe_step = 0
    order = ["probe", "plain", "plain", "probe"]
    blocks = args.steps // args.block
    start = time.perf_counter()
    for b in range(2 * blocks):
        name = order[b % 4]
        copy = copies[name]
        for _ in range(args.block):
            ms = copy.step()
            if name == "probe":
                if config.is_sampled(probe_step):
                    sampled.append(ms)
                elif config.is_sampled(probe_step + 1):
                    before_sampled.append(ms)
                probe.step()
                probe_step += 1
            copy.times.append(ms)
        if name == "probe":  # drain, so the probe's background work cannot slow B
            t = time.perf_counter()
            probe.flush()
            if device.type == "cuda":
                torch.cuda.synchronize()
            drain_ms += (time.perf_counter() - t) * 1e3
    wall_s = time.perf_counter() - start

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    mode = "smoke" if args.smoke else device.type
    tables_dir = out / f"probe_overhead_{mode}_{stamp}_tables"
    t = time.perf_counter()
    probe.save(tables_dir)
    tables_s = time.perf_counter() - t
    tables = probe.tables()
    counters = probe.counters
    probe.detach()

    a, b = copies["probe"].times, copies["plain"].times
    median_b = statistics.median(b)
    errors = tables["site_errors"]
    summary = {
        "steps_per_copy": len(a),
        "plain_median_ms": median_b,
        "plain_mean_ms": statistics.fmean(b),
        "probe_median_ms": statistics.median(a),
        "probe_mean_ms": statistics.fmean(a),
        "overhead": sum(a) / sum(b) - 1,
        # After the warm-up schedule: what a long run pays (vs the plain copy's mean step).
        "steady_steps": len(a[config.warmup_steps :]),
        "overhead_steady": statistics.fmean(a[config.warmup_steps :]) / statistics.fmean(b) - 1
        if len(a) > config.warmup_steps
        else None,
        "overhead_incl_drain": (sum(a) + drain_ms) / sum(b) - 1,
        "drain_ms_total": drain_ms,
        "sampled_steps": len(sampled),
        "sampled_step_extra_ms": statistics.median(sampled) - median_b if sampled else None,
        "sampled_step_extra_ms_max": max(sampled) - median_b if sampled else None,
        "amax_step_extra_ms": statistics.median(before_sampled) - median_b
        if before_sampled
        else None,
        "probe_device_ms_per_sampled_step": counters["device_ms"]
        / max(counters["sampled_steps"], 1),
        "probe_worker_s_per_sampled_step": counters["worker_busy_s"]
        / max(counters["worker_jobs"], 1),
        "dropped_steps": counters["dropped_steps"],
        "probe_errors": probe.errors[:5],
        "sites": len(tables["sites"]),
        "time_share_sum": float(tables["sites"]["time_share"].sum() or 0.0),
        "verdicts": {
            v: int((errors["verdict"] == v).sum()) for v in ("safe", "unsafe", "undecided")
        },
        "tables_s": tables_s,
        "wall_s": wall_s,
    }
    record = {
        "meta": meta,
        "summary": summary,
        "counters": counters,
        "probe_config": repr(config),
        "times_ms": {"probe": a, "plain": b, "sampled": sampled, "before_sampled": before_sampled},
        "tables_dir": str(tables_dir),
    }
    path = out / f"probe_overhead_{mode}_{stamp}.json"
    write_json(path, record)

    print(
        f"\nloka.probe overhead: {args.model} {args.preset} on {meta['device']}, {len(a)} steps per copy"
    )
    rows = [
        ("plain step (median / mean)", f"{median_b:.2f} / {statistics.fmean(b):.2f} ms"),
        ("probed step (median / mean)", f"{statistics.median(a):.2f} / {statistics.fmean(a):.2f} ms"),
        ("overhead (sum of step times)", f"{100 * summary['overhead']:+.2f}%"),
        ("overhead after warm-up (steady state)",
         f"{100 * summary['overhead_steady']:+.2f}% over {summary['steady_steps']} steps"
         if summary["overhead_steady"] is not None else "-"),
        ("overhead incl. drain (upper bound)", f"{100 * summary['overhead_incl_drain']:+.2f}%"),
        ("sampled steps", f"{len(sampled)} (dropped {counters['dropped_steps']})"),
        ("sampled step: extra time (median / max)", f"{summary['sampled_step_extra_ms'] or 0:.2f} / {summary['sampled_step_extra_ms_max'] or 0:.2f} ms"),
        ("amax step before it: extra (median)", f"{summary['amax_step_extra_ms'] or 0:.2f} ms"),
        ("side-stream device time / sampled step", f"{summary['probe_device_ms_per_sampled_step']:.2f} ms"),
        ("background thread / sampled step", f"{summary['probe_worker_s_per_sampled_step'] * 1e3:.1f} ms"),
        ("sites; sum of time_share", f"{summary['sites']}; {summary['time_share_sum']:.3f}"),
        ("verdicts safe/unsafe/undecided", "/".join(str(v) for v in summary["verdicts"].values())),
    ]  # fmt: skip
    errors_seen = probe.errors
    rows.append(
        (
            "probe capture/analysis errors",
            f"{len(errors_seen)}" + (f" (first: {errors_seen[0]})" if errors_seen else ""),
        )
    )
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
    print(f"wrote {path} and {tables_dir}/")


if __name__ == "__main__":
    main()
