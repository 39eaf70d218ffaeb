"""A warm-up too short to decide the FP8 verdicts gives an all-bf16 plan: a Session warns
with the reason and about how many sampled batches would decide (in Lightning or HF nobody
reads its events)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def test_a_session_warns_when_the_warm_up_ended_undecided(tmp_path) -> None:
    import loka.zoo as zoo
    from loka.dispatch import Session, SessionConfig
    from loka.dispatch.integrations.session import UndecidedPlanWarning
    from loka.dispatch.testing import synthetic_kernel_bench
    from loka.probe import ProbeConfig

    setup = zoo.create("dhen", "tiny", seed=2, batch_size=32)
    probe = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, min_batches=5,
                        rows=32, queue_size=16)  # fmt: skip
    config = SessionConfig(warmup_steps=2, probe=probe, decide_steps=0,
                           kernel_bench=synthetic_kernel_bench([(32, 32, 64)]))  # fmt: skip
    session = Session(setup.model, config)
    with pytest.warns(UndecidedPlanWarning, match=r"after a warm-up of 2 step\(s\).*undecided"):
        zoo.train(setup, 2, on_step=lambda step, loss: session.step(loss))
    assert session.plan.summary.sites_fp8 == 0


def test_a_session_probes_on_to_decide_what_would_change_its_plan(tmp_path) -> None:
    """With `decide_steps`, a warm-up whose plan undecided verdicts hold back goes on until
    about as many batches as would decide them were sampled (at most `decide_steps` more),
    then plans again from the same kernel timings; the verdicts it waited for are decided
    after more batches than the first warm-up gave."""
    import loka.zoo as zoo
    from loka.dispatch import Session, SessionConfig
    from loka.dispatch.testing import synthetic_kernel_bench
    from loka.probe import ProbeConfig

    setup = zoo.create("dhen", "tiny", seed=2, batch_size=32)
    probe = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, min_batches=5,
                        rows=32, queue_size=64)  # fmt: skip
    bench = synthetic_kernel_bench([(32, 32, 64)])
    config = SessionConfig(warmup_steps=2, probe=probe, kernel_bench=bench, verify=None)
    assert config.decide_limit == 8  # on by default: up to 4 x the warm-up
    session = Session(setup.model, config)
    zoo.train(setup, 2, on_step=lambda step, loss: session.step(loss))
    assert session.phase == "warmup" and 2 < session.warmup_end <= 10
    (event,) = [e for e in session.events if e.startswith("warm-up extended by")]
    assert "would change the plan" in event and "sampled batches would decide" in event
    waited = session.warmup_end
    zoo.train(setup, waited - 2, on_step=lambda step, loss: session.step(loss))
    assert session.phase == "applied" and session.steps == waited
    assert session.kernel_bench is bench  # timed (here: given) once, planned twice
    n = session.tables["site_errors"]["n"].max()
    assert n > 2  # the verdicts were judged on the batches of the longer warm-up
    # With decide_steps=0 the same warm-up plans at once.
    setup = zoo.create("dhen", "tiny", seed=2, batch_size=32)
    plain = Session(setup.model, SessionConfig(warmup_steps=2, probe=probe, kernel_bench=bench,
                                               verify=None, decide_steps=0))  # fmt: skip
    with pytest.warns(UserWarning):
        zoo.train(setup, 2, on_step=lambda step, loss: plain.step(loss))
    assert plain.phase == "applied" and plain.warmup_end == 2
    with pytest.raises(ValueError, match="decide_steps must be >= 0"):
        SessionConfig(decide_steps=-1)


def test_steps_to_decide_counts_the_sampled_steps_and_respects_the_gain_and_limit() -> None:
    from loka.dispatch.integrations.session import steps_to_decide
    from loka.dispatch.planner import PlanSummary

    def summary_of(undecided_stakes, predicted_speedup, gemm_speedup) -> PlanSummary:
        return PlanSummary(
            sites=1, sites_fp8=0, passes_fp8=0, gemm_speedup=gemm_speedup, prequant_speedup=1.8,
            gemm_share=0.5, predicted_speedup=predicted_speedup, ceiling=1.3, estimated=False,
            device="test", undecided_stakes=undecided_stakes,
        )  # fmt: skip

    from loka.probe import ProbeConfig

    every_4 = ProbeConfig(every=4, warmup_steps=0)
    stakes = {"batches": 10, "seen": 7, "predicted_speedup": 1.05, "gemm_speedup": 1.3}
    summary = summary_of(undecided_stakes=stakes, predicted_speedup=1.02, gemm_speedup=1.1)
    # 3 more batches from step 10: sampled at 12, 16, 20 -> 11 steps (10..20)
    assert steps_to_decide(summary, every_4, 10, limit=100) == 11
    assert steps_to_decide(summary, every_4, 10, limit=5) == 5
    small = summary_of(undecided_stakes=stakes, predicted_speedup=1.049, gemm_speedup=1.1)
    assert steps_to_decide(small, every_4, 10, limit=100) == 0  # gains < DECIDE_MIN_GAIN
    none = summary_of(undecided_stakes=None, predicted_speedup=1.0, gemm_speedup=1.0)
    assert steps_to_decide(none, every_4, 10, limit=100) == 0
