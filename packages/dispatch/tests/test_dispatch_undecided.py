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
    config = SessionConfig(warmup_steps=2, probe=probe,
                           kernel_bench=synthetic_kernel_bench([(32, 32, 64)]))  # fmt: skip
    session = Session(setup.model, config)
    with pytest.warns(UndecidedPlanWarning, match=r"after a warm-up of 2 step\(s\).*undecided"):
        zoo.train(setup, 2, on_step=lambda step, loss: session.step(loss))
    assert session.plan.summary.sites_fp8 == 0
