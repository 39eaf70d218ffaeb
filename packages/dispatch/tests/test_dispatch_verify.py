"""Verification on the real step: the statistics, the decision loop (a fake timer whose step
time depends on the sites in FP8), switching applied sites in place, `verify` on a model and
the Session's verifying phase."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # FP8 passes run in Triton's interpreter

import copy
import dataclasses
import math
import random

import polars as pl
import pytest
import torch
from scipy import stats
from torch import nn

from loka.dispatch import PlanConfig, Session, SessionConfig, apply, make_plan
from loka.dispatch.tables import read_plan
from loka.dispatch.testing import synthetic_kernel_bench
from loka.dispatch.verify import Verifier, VerifyConfig, verify
from loka.dispatch.verify_stats import compare, t_quantile
from loka.mods.fp8_linear import Fp8Linear
from loka.schema import PASSES, validate

ROW = "e4m3:e4m3/row/dynamic"
FAST = VerifyConfig(steps_per_block=4, drop=1, blocks=3)  # 24 steps a round
SHORT = VerifyConfig(steps_per_block=2, drop=1, blocks=3)  # 12 real (interpreted) steps a round


# -- statistics ----------------------------------------------------------------------------


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 7, 30])
@pytest.mark.parametrize("confidence", [0.8, 0.9, 0.95, 0.99])
def test_t_quantile_matches_scipy(dof: int, confidence: float) -> None:
    expected = stats.t.ppf(0.5 + confidence / 2, dof)
    assert t_quantile(confidence, dof) == pytest.approx(expected, rel=1e-9)


def test_compare_is_the_ratio_of_medians_with_a_paired_t_interval() -> None:
    planned, bf16 = [1.0, 1.02, 0.99, 1.01], [1.10, 1.11, 1.08, 1.12]
    result = compare(planned, bf16, confidence=0.9)
    assert result.speedup == pytest.approx(1.105 / 1.005)
    logs = [math.log(b / p) for p, b in zip(planned, bf16, strict=True)]
    mean, sem = sum(logs) / 4, stats.sem(logs)
    low, high = stats.t.interval(0.9, 3, loc=mean, scale=sem)
    assert (result.low, result.high) == pytest.approx((math.exp(low), math.exp(high)))
    assert result.pairs == 4
    # No noise: the interval closes on the ratio.
    exact = compare([2.0] * 3, [1.0] * 3)
    assert exact.speedup == exact.low == exact.high == pytest.approx(0.5)
    with pytest.raises(ValueError, match="3 planned blocks against 2"):
        compare([1.0] * 3, [1.0] * 2)
    with pytest.raises(ValueError, match="positive"):
        compare([1.0, 0.0], [1.0, 1.0])


def test_verify_config_rejects_settings_without_a_valid_measurement() -> None:
    with pytest.raises(ValueError, match="blocks must be >= 3"):
        VerifyConfig(blocks=2)
    with pytest.raises(ValueError, match="drop must be >= 1"):
        VerifyConfig(drop=0)
    with pytest.raises(ValueError, match="must exceed drop"):
        VerifyConfig(steps_per_block=2, drop=2)
    assert VerifyConfig().steps_per_round == 60


# -- the decision loop ---------------------------------------------------------------------


class FakeStep:
    """The active set (the verifier's switch) and a timer whose step time is `base` times the
    factor of every active site, times lognormal noise; the first step after each switch
    costs `switch_cost` more (a recompile), which the dropped steps must absorb."""

    def __init__(self, factors: dict[str, float], noise: float = 0.0, switch_cost: float = 0.0,
                 seed: int = 0, base: float = 0.1) -> None:  # fmt: skip
        self.factors, self.noise, self.switch_cost, self.base = factors, noise, switch_cost, base
        self.rng = random.Random(seed)
        self.active: frozenset[str] = frozenset()
        self.switches: list[frozenset[str]] = []
        self.times: list[float] = []

    def switch(self, active: frozenset[str]) -> None:
        self.active = active
        self.switches.append(active)

    def time(self) -> float:
        t = self.base * math.prod(self.factors[s] for s in self.active)
        return t * math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else t

    # StepTimer
    def start(self) -> None:
        self.times = []

    def mark(self) -> None:
        extra = self.switch_cost if not self.times else 0.0
        self.times.append(self.time() + extra)

    def collect(self) -> list[float]:
        times, self.times = self.times, []
        return times


def run(fake: FakeStep, config: VerifyConfig = FAST, **kwargs) -> Verifier:
    verifier = Verifier(list(fake.factors), fake.switch, config, fake, **kwargs)
    while not verifier.done:
        verifier.step()
    assert verifier.steps <= config.max_rounds * config.steps_per_round
    assert fake.active == frozenset(verifier.result.kept)  # the switch holds the outcome
    return verifier


class RecordingStep(FakeStep):
    """CUDA graphs: a set's first `slow_steps` steps (warm-up and one recording per input
    shape) cost `record_cost` more each, counted from its first switch-in whether or not
    the verifier times them."""

    def __init__(self, factors: dict[str, float], slow_steps: int, record_cost: float) -> None:
        super().__init__(factors)
        self.slow_steps, self.record_cost = slow_steps, record_cost
        self.runs: dict[frozenset[str], int] = {}
        self.last = 0.0

    def step(self) -> None:
        self.runs[self.active] = self.runs.get(self.active, 0) + 1
        recording = self.runs[self.active] <= self.slow_steps
        self.last = self.time() + (self.record_cost if recording else 0.0)

    def mark(self) -> None:
        self.times.append(self.last)


@pytest.mark.parametrize("mode", ["cudagraphs", "compiled"])
def test_a_new_set_under_cuda_graphs_settles_before_it_is_timed(mode: str) -> None:
    config = VerifyConfig(steps_per_block=10, drop=2, blocks=3, max_rounds=3)
    fake = RecordingStep({"a": 0.95, "b": 1.06}, slow_steps=8, record_cost=1.0)
    verifier = Verifier(list(fake.factors), fake.switch, config, fake, mode=mode)
    while not verifier.done:
        fake.step()
        verifier.step()
    result = verifier.result
    assert not result.rounds[0].accepted  # a and b together: 1.007x, slower
    assert result.rounds[1].active == ("a",)
    if mode == "cudagraphs":  # settle_steps: steps_per_block untimed for each new set
        assert config.settle_for(mode) == 10
        assert result.kept == ["a"] and result.speedup == pytest.approx(1 / 0.95)
        settling = 10 * len(set(fake.switches))  # {a, b}, bf16, {a}, {b}
        assert result.steps == len(result.rounds) * config.steps_per_round + settling
    else:
        # Untimed steps only where asked: here {a}'s first block times its recording, and
        # one such pair of blocks leaves the interval nothing to say.
        assert config.settle_for(mode) == 0
        assert result.rounds[1].verdict == "not shown to be as fast as bf16"
        assert result.rounds[1].low < 0.5 and result.kept == []
    assert VerifyConfig(settle_steps=3).settle_for("cudagraphs") == 3
    with pytest.raises(ValueError, match="settle_steps must be >= 0"):
        VerifyConfig(settle_steps=-1)


def test_a_faster_site_is_kept_and_a_slower_one_demoted_even_when_predicted_better() -> None:
    fake = FakeStep({"a": 0.9, "b": 1.2}, noise=0.01, switch_cost=1.0)
    verifier = run(fake, gains={"b": 2.0, "a": 1.0})  # b predicted to gain more
    result = verifier.result
    assert result.sites == ["b", "a"]  # bisection order: predicted gain
    assert result.kept == ["a"] and list(result.demoted) == ["b"]
    assert "slower than bf16" in result.demoted["b"]
    assert result.speedup == pytest.approx(1 / 0.9, rel=0.03) and result.low >= 0.99
    assert result.rounds[0].active == ("b", "a") and not result.rounds[0].accepted
    assert result.steps == len(result.rounds) * FAST.steps_per_round
    # Blocks alternate planned and bf16 within every round.
    assert fake.switches[:6] == [frozenset({"a", "b"}), frozenset()] * 3


def test_all_slower_sites_are_demoted_and_the_step_is_bf16() -> None:
    fake = FakeStep({f"s{i}": 1.03 for i in range(4)}, noise=0.005)
    result = run(fake).result
    assert result.kept == [] and set(result.demoted) == set(fake.factors)
    assert result.speedup == 1.0 and result.low is None
    assert all(not r.accepted for r in result.rounds)
    assert "no FP8 site kept" in result.lines()[-5]


def test_all_faster_sites_are_all_kept_after_one_round() -> None:
    fake = FakeStep({f"s{i}": 0.97 for i in range(4)}, noise=0.005, switch_cost=0.5)
    result = run(fake).result
    assert result.kept == list(fake.factors) and result.demoted == {}
    assert len(result.rounds) == 1 and result.steps == FAST.steps_per_round
    assert result.speedup == pytest.approx(0.97**-4, rel=0.02)


@pytest.mark.parametrize("seed", range(8))
def test_noisy_but_equal_never_ends_slower_than_bf16_with_confidence(seed: int) -> None:
    fake = FakeStep({f"s{i}": 1.0 for i in range(5)}, noise=0.03, seed=seed)
    config = VerifyConfig(steps_per_block=4, drop=1, blocks=3, max_rounds=4)
    result = run(fake, config).result
    if result.kept:
        best = [r for r in result.rounds if r.active == tuple(result.kept)][-1]
        assert best.accepted and best.speedup >= 1.0 and best.low >= 1.0 - config.tolerance
        assert result.speedup == best.speedup
    else:
        assert set(result.demoted) == set(fake.factors) and result.speedup == 1.0
    assert len(result.rounds) <= config.max_rounds


def test_a_gain_below_the_prediction_starts_a_search_that_keeps_the_fastest_set() -> None:
    factors = {"a": 0.99, "b": 0.99, "c": 0.99, "d": 1.0}
    kwargs = {"gains": dict.fromkeys(factors, 1.0), "predicted": 1.25}
    checked = run(FakeStep(factors), **kwargs).result
    assert "below the prediction" in checked.rounds[0].verdict
    assert len(checked.rounds) > 1
    # The fastest measured set that is not slower than bf16: a, b, c (d adds nothing).
    assert set(checked.kept) >= {"a", "b", "c"}
    assert checked.predicted == pytest.approx(1.25)
    unchecked = run(FakeStep(factors), VerifyConfig(steps_per_block=4, drop=1, blocks=3,
                                                    check_prediction=False), **kwargs).result  # fmt: skip
    assert len(unchecked.rounds) == 1 and unchecked.kept == list(factors)


def test_predictions_of_subsets_split_the_saving_by_kernel_gain() -> None:
    verifier = Verifier(["a", "b"], lambda active: None, FAST, FakeStep({}),
                        gains={"a": 3.0, "b": 1.0, "fallback": 1.0}, predicted=1.25)  # fmt: skip
    # All of `gains` in FP8 saves 20% of the step; a saves 3/5 of that.
    assert verifier.predicted_for(["a", "b", "fallback"]) == pytest.approx(1.25)
    assert verifier.predicted_for(["a"]) == pytest.approx(1 / (1 - 0.2 * 3 / 5))
    assert verifier.predicted_for([]) == pytest.approx(1.0)


def test_predictions_from_the_measured_bf16_step_use_the_kernel_time_saved() -> None:
    # bf16 step 100 ms; the kernels of a save 10 ms (and it does), of b 2 ms (it costs 1%).
    factors = {"a": 0.9, "b": 1.01}
    verifier = run(FakeStep(factors), saving_ms={"a": 10.0, "b": 2.0}, gains={"a": 10.0, "b": 2.0},
                   predicted=1.01)  # fmt: skip
    result = verifier.result
    assert verifier.predicted_for(["a"], 100.0) == pytest.approx(100 / 90)
    assert verifier.predicted_for(["a", "b"], 100.0) == pytest.approx(100 / 88)
    assert result.bf16_step_ms == pytest.approx(100.0)
    # Round 0 (a and b: 1.100x measured against 1.136x predicted from the step) gains less
    # than predicted: the search keeps a alone, which meets its step-based prediction.
    assert result.rounds[0].predicted == pytest.approx(100 / 88)
    assert "below the prediction" in result.rounds[0].verdict
    assert result.kept == ["a"] and result.predicted_kept == pytest.approx(100 / 90)
    # Without a saving per site the share-based prediction stands (1.01: met at once, and
    # b stays in FP8 though it costs 1%).
    share = run(FakeStep(factors), gains={"a": 10.0, "b": 2.0}, predicted=1.01).result
    assert share.rounds[0].verdict == "not slower than bf16" and len(share.rounds) == 1
    assert share.predicted == pytest.approx(1.01)


def test_rounds_are_bounded_and_unmeasured_sites_say_so() -> None:
    fake = FakeStep({f"s{i}": 1.02 for i in range(8)})
    config = VerifyConfig(steps_per_block=4, drop=1, blocks=3, max_rounds=3)
    result = run(fake, config).result
    assert len(result.rounds) == 3 and result.steps == 3 * config.steps_per_round
    assert result.kept == [] and len(result.demoted) == 8
    assert any("max_rounds (3)" in reason for reason in result.demoted.values())


def test_nothing_to_verify_takes_no_step() -> None:
    verifier = Verifier([], lambda active: None, FAST, FakeStep({}))
    assert verifier.done and verifier.result.steps == 0 and verifier.result.kept == []


def test_times_are_reduced_across_ranks_before_deciding() -> None:
    fake = FakeStep({"a": 0.9})
    slowest = run(fake, reduce=lambda t: t * 1.5 if fake.active else t).result  # rank skew
    assert slowest.kept == [] and "a" in slowest.demoted


# -- in place, on a model ------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def tiny_plan(model: nn.Module, fuse: bool = False, config: PlanConfig | None = None):
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    sites = pl.DataFrame(
        [{"site": n, "kind": "linear", "K": m.in_features, "N": m.out_features, "M_min": 32,
          "M_p50": 32, "M_max": 32, "calls": 1, "groups": 1, "has_bias": True,
          "dtype": "float32", "fwd_ms": None, "bwd_ms": None, "time_share": 0.2,
          "norm": "norm" if fuse and n == "fc1" else None}
         for n, m in linears],
        schema_overrides={"fwd_ms": pl.Float64, "bwd_ms": pl.Float64, "norm": pl.String},
    )  # fmt: skip
    errors = pl.DataFrame(
        [{"site": n, "recipe": ROW, "pass": p, "n": 8, "mean_rel_err": 0.035, "std_rel_err": 0.001,
          "lcb_rel_err": 0.034, "ucb_rel_err": 0.036, "sqnr_db": 29.0, "max_abs_err": 0.1,
          "bf16_rel_err": 0.003, "budget": 0.06 if p == "fwd" else 0.09, "confidence": 0.95,
          "method": "student-t", "verdict": "safe", "emulated": True, "step_last": 7}
         for n, _ in linears for p in PASSES]
    )  # fmt: skip
    bench = synthetic_kernel_bench(
        [(32, 32, 64), (32, 64, 32)], fp8_ms=0.97 if fuse else 0.5,
        norm_shapes=[(32, 32)] if fuse else (),
    )  # fmt: skip
    return make_plan(validate(sites, "sites"), validate(errors, "site_errors"), bench, config)


def test_switching_keeps_parameters_and_gives_back_the_original_modules() -> None:
    torch.manual_seed(0)
    model = Tiny()
    params = list(model.parameters())
    originals = dict(model.named_modules())
    x = torch.randn(32, 32)
    with torch.no_grad():
        reference = model(x)
    applied = apply(model, tiny_plan(model))
    assert applied.sites == ["fc1", "fc2"] and type(model.fc1) is Fp8Linear
    planned = {s: model.get_submodule(s) for s in applied.sites}
    applied.use(set())
    assert model.fc1 is originals["fc1"] and model.fc2 is originals["fc2"]
    assert applied.active == [] and all(
        a is b for a, b in zip(model.parameters(), params, strict=True)
    )
    with torch.no_grad():
        assert torch.equal(model(x), reference)
    applied.use({"fc2"})
    assert model.fc1 is originals["fc1"] and model.fc2 is planned["fc2"]
    assert applied.active == ["fc2"]
    applied.use(applied.sites)
    assert all(model.get_submodule(s) is planned[s] for s in applied.sites)
    with pytest.raises(ValueError, match="not FP8 sites"):
        applied.use({"norm"})
    # Demotion puts the original back for good; `use` leaves demoted sites alone.
    assert applied.demote("fc1", "test")
    assert model.fc1 is originals["fc1"]
    applied.use(applied.sites[1:])
    assert model.fc1 is originals["fc1"] and applied.active == ["fc2"]
    applied.undo()
    assert all(model.get_submodule(n) is m for n, m in originals.items())


def test_a_fused_site_switches_its_norm_too() -> None:
    from loka.mods.norm_linear import FusedNorm, NormLinear

    torch.manual_seed(0)
    model = Tiny()
    originals = dict(model.named_modules())
    x = torch.randn(32, 32)
    with torch.no_grad():
        reference = model(x)
    plan = tiny_plan(model, fuse=True)
    assert plan.table.filter(pl.col("fuse_norm"))["site"].to_list() == ["fc1"]
    applied = apply(model, plan, sample=x)
    assert type(model.fc1) is NormLinear and type(model.norm) is FusedNorm
    applied.use(set())
    assert model.norm is originals["norm"] and model.fc1 is originals["fc1"]
    with torch.no_grad():
        assert torch.equal(model(x), reference)
    applied.use({"fc1"})
    assert type(model.fc1) is NormLinear and model.fc1.norm is model.norm


def sgd_step(model: nn.Module):
    """One whole training step of `model` on a fixed batch (SGD), as verification calls it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 32)

    def step_fn() -> None:
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step_fn


def test_verify_drives_training_steps_demotes_and_records_in_the_plan(tmp_path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    originals = dict(model.named_modules())
    applied = apply(model, tiny_plan(model))
    step_fn = sgd_step(model)

    fake = FakeStep({"fc1": 0.9, "fc2": 1.2})
    fake.time = lambda: 0.1 * math.prod(fake.factors[s] for s in applied.active)
    events: list[str] = []
    result = verify(step_fn, applied, SHORT, fake, on_event=events.append)
    assert result.kept == ["fc1"] and list(result.demoted) == ["fc2"]
    assert model.fc2 is originals["fc2"] and type(model.fc1) is Fp8Linear
    assert applied.demoted["fc2"].startswith("verify: ")
    summary = applied.plan.summary
    assert summary.measured_speedup == pytest.approx(1 / 0.9)
    assert summary.verified_sites == ["fc1"] and list(summary.verify_demoted) == ["fc2"]
    assert any(line.startswith("end-to-end: measured on the real step") for line in summary.lines())
    assert any("demoted by verification: fc2" in line for line in summary.lines())
    assert any(e.startswith("verifying 2 FP8 site(s)") for e in events)
    # A saved plan carries the measurement.
    applied.plan.write(tmp_path / "plan.parquet")
    assert read_plan(tmp_path / "plan.parquet").summary.verify_demoted == summary.verify_demoted
    copy.deepcopy(summary)  # plain data


class _FsdpMixin:
    """Stands in for FSDP2's FSDPModule: what `loka.mods.sharding` reads of a wrapped class."""

    _orig_cls_mro_index = 2


def test_verify_switches_fsdp_managed_sites_by_their_config_in_place() -> None:
    torch.manual_seed(0)
    model = Tiny()
    for name in ("fc1", "fc2"):  # as fully_shard(linear) leaves them
        linear = model.get_submodule(name)
        linear.__class__ = type("FSDPLinear", (_FsdpMixin, nn.Linear), {})
    originals = dict(model.named_modules())
    applied = apply(model, tiny_plan(model))
    assert applied.sites == ["fc1", "fc2"] and all(
        model.get_submodule(s) is originals[s] and isinstance(originals[s], Fp8Linear)
        for s in applied.sites
    )
    planned = {s: originals[s].fp8_config for s in applied.sites}
    fake = FakeStep({"fc1": 0.9, "fc2": 1.2})
    fake.time = lambda: 0.1 * math.prod(fake.factors[s] for s in applied.active)
    result = verify(sgd_step(model), applied, SHORT, fake)
    assert result.kept == ["fc1"] and list(result.demoted) == ["fc2"]
    assert dict(model.named_modules()) == originals  # nothing swapped, ever
    assert model.fc1.fp8_config == planned["fc1"] and model.fc2.plan.all_high_precision
    assert applied.active == ["fc1"]
    applied.undo()
    assert type(model.fc1).__name__ == type(model.fc2).__name__ == "FSDPLinear"


def test_serving_is_verified_on_the_forward_and_a_demoted_site_frees_its_fp8_weight() -> None:
    from loka.dispatch.verify import verifier_for

    torch.manual_seed(0)
    model = Tiny().eval()
    originals = dict(model.named_modules())
    applied = apply(model, tiny_plan(model, config=PlanConfig(inference=True)))
    assert applied.prequantized == ["fc1", "fc2"]
    planned_fc2 = model.fc2
    assert verifier_for(applied)._parameters is None  # a served forward trains nothing
    x = torch.randn(32, 32)

    def serve() -> None:
        with torch.no_grad():
            model(x)

    fake = FakeStep({"fc1": 0.9, "fc2": 1.2})
    fake.time = lambda: 0.1 * math.prod(fake.factors[s] for s in applied.active)
    result = verify(serve, applied, SHORT, fake)
    assert result.kept == ["fc1"] and list(result.demoted) == ["fc2"]
    assert model.fc2 is originals["fc2"] and model.fc1.prequantized
    # The demoted site's FP8 copy is gone, not held by the module kept for `use`.
    assert applied.prequantized == ["fc1"] and not planned_fc2.prequantized
    assert "1 with the weight prequantized" in applied.summary()
    with torch.no_grad():
        served = model(x)
    applied.use(set())  # bf16 everywhere: the kept FP8 site changed the output, fc2 did not
    with torch.no_grad():
        assert not torch.equal(served, model(x))
    training = apply(Tiny(), tiny_plan(Tiny()))
    assert verifier_for(training)._parameters is not None


def test_verify_of_a_compiled_plan_raises_dynamos_recompile_limit() -> None:
    # A served model verified directly (no Session): every set is one more compiled variant.
    torch.manual_seed(0)
    model = Tiny().eval()
    applied = apply(model, tiny_plan(model, config=PlanConfig(inference=True)))
    fake = FakeStep({"fc1": 0.9, "fc2": 0.9})
    fake.time = lambda: 0.1 * math.prod(fake.factors[s] for s in applied.active)
    before = torch._dynamo.config.recompile_limit
    events: list[str] = []
    try:
        torch._dynamo.config.recompile_limit = 8
        verify(lambda: None, applied, SHORT, fake, mode="eager")
        assert torch._dynamo.config.recompile_limit == 8  # eager: nothing compiles
        verify(lambda: None, applied, SHORT, fake, on_event=events.append, mode="compiled")
        assert torch._dynamo.config.recompile_limit == 2 * SHORT.max_rounds + 4
        assert any("recompile_limit raised" in e for e in events)
    finally:
        torch._dynamo.config.recompile_limit = before


def test_verify_settles_each_new_set_when_the_plan_runs_under_cuda_graphs() -> None:
    torch.manual_seed(0)
    model = Tiny()
    applied = apply(model, tiny_plan(model))
    fake = FakeStep({"fc1": 0.9, "fc2": 0.9})
    fake.time = lambda: 0.1 * math.prod(fake.factors[s] for s in applied.active)
    events: list[str] = []
    result = verify(sgd_step(model), applied, SHORT, fake, on_event=events.append,
                    mode="cudagraphs")  # fmt: skip
    assert len(result.rounds) == 1 and result.kept == ["fc1", "fc2"]
    # SHORT's blocks are 2 steps: 2 more, untimed, for the planned set and for bf16's.
    assert result.steps == SHORT.steps_per_round + 2 * 2
    assert any("2 untimed steps for each new set" in e for e in events)


# -- Session ---------------------------------------------------------------------------------


def test_session_verifies_after_applying_and_settles_on_the_verified_sites(tmp_path) -> None:
    import loka.zoo as zoo
    from loka.probe import ProbeConfig

    setup = zoo.create("dhen", "tiny", seed=2, batch_size=32)
    originals = dict(setup.model.named_modules())
    probe = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, min_batches=2,
                        rows=32, queue_size=16)  # fmt: skip
    config = SessionConfig(
        warmup_steps=2, probe=probe, kernel_bench=synthetic_kernel_bench([(32, 32, 64)]),
        plan=PlanConfig(exclude=("*blocks.1.*",)), out_dir=tmp_path,
        verify=dataclasses.replace(SHORT, on_cpu=True),
    )  # fmt: skip
    fake = FakeStep({"blocks.0.fc1": 1.3})  # FP8 makes this step slower
    events: list[str] = []
    session = Session(setup.model, config, on_event=events.append, timer=fake)
    fake.time = lambda: 0.1 * (1.3 if session.applied.active else 1.0)
    phases = []
    zoo.train(setup, 2 + 12 + 1, on_step=lambda step, loss: (session.step(loss),
                                                             phases.append(session.phase)))  # fmt: skip
    assert phases[:2] == ["warmup", "verifying"] and phases[2:13] == ["verifying"] * 11
    assert phases[13:] == ["applied", "applied"]
    assert session.applied.sites == ["blocks.0.fc1"] and "blocks.0.fc1" in session.applied.demoted
    assert setup.model.blocks[0].fc1 is originals["blocks.0.fc1"]
    summary = session.plan.summary
    assert summary.measured_speedup == 1.0  # nothing kept: the step is bf16
    # The ceiling as the measured bf16 step runs the planned sites (their bf16 kernels).
    # The fake step: 100 ms; the synthetic bench's bf16 kernels of the planned sites: 6 ms.
    assert summary.measured_bf16_step_ms == pytest.approx(100.0)
    assert summary.gemm_share_from_step == pytest.approx(summary.bf16_gemm_ms / 100.0)
    assert summary.ceiling_from_step is not None and summary.ceiling_from_step >= 1.0
    assert any("round 0: 1 FP8 site(s)" in e for e in events)
    assert any(e.startswith("verified after 14 step(s)") for e in events)
    report = (tmp_path / "report.html").read_text()
    assert "measured on the real step" in report and "demoted by verification" in report
    assert 'id="verification"' in report and "<td>slower than bf16<td" in report
    session.close()
    # The default verifies GPU models only.
    assert SessionConfig().verify == VerifyConfig() and not VerifyConfig().on_cpu


class FakeGradients:
    """Named parameters whose gradients the active set decides: a site in `breaks` leaves
    `victim` with a zero gradient (the compiled zero-gradient bug), others train all."""

    def __init__(self, fake: FakeStep, breaks: set[str], victim: str = "up.weight") -> None:
        self.fake, self.breaks, self.victim = fake, breaks, victim
        self.params = {n: torch.nn.Parameter(torch.ones(3)) for n in ("up.weight", "fc.weight")}

    def __call__(self):
        for name, p in self.params.items():
            broken = name == self.victim and self.fake.active & self.breaks
            p.grad = torch.zeros(3) if broken else torch.ones(3)
        return self.params.items()


def test_a_faster_set_that_loses_gradients_is_refused_and_its_site_demoted() -> None:
    fake = FakeStep({"good": 0.95, "bad": 0.8}, noise=0.005)
    verifier = run(fake, parameters=FakeGradients(fake, {"bad"}))
    result = verifier.result
    assert result.kept == ["good"] and list(result.demoted) == ["bad"]
    assert "changes the gradients: 1 parameter(s) get none (up.weight)" in result.demoted["bad"]
    first = result.rounds[0]
    assert not first.accepted and first.lost_gradients == ("up.weight",)
    assert first.speedup > 1.2  # faster, and refused all the same
    assert first.as_dict()["lost_gradients"] == ["up.weight"]


def test_gradients_cleared_after_the_step_are_not_mistaken_for_lost_ones() -> None:
    fake = FakeStep({"a": 0.9}, noise=0.005)
    params = {"w": torch.nn.Parameter(torch.ones(2))}  # grad None: zeroed after each step
    result = run(fake, parameters=lambda: params.items()).result
    assert result.kept == ["a"] and not result.rounds[0].lost_gradients


def test_pass_units_switch_and_demote_one_pass_of_a_site() -> None:
    torch.manual_seed(0)
    model = Tiny()
    originals = dict(model.named_modules())
    applied = apply(model, tiny_plan(model))
    units = applied.pass_units()
    assert units == [f"{s}/{p}" for s in ("fc1", "fc2") for p in PASSES]
    applied.use_units({"fc1/fwd"})
    config = model.fc1.fp8_config
    assert type(model.fc1) is Fp8Linear and not config.fwd.is_bf16
    assert config.dgrad.is_bf16 and config.wgrad.is_bf16 and model.fc2 is originals["fc2"]
    applied.use_units(units)
    assert all(not c.is_bf16 for c in model.fc1.fp8_config.passes().values())
    with pytest.raises(ValueError, match="not live FP8 units"):
        applied.use_units({"fc1/backward"})
    # One pass demoted: the site stays FP8 without it; its last pass demotes the site.
    assert applied.demote_pass("fc2", "wgrad", "test")
    assert model.fc2.fp8_config.wgrad.is_bf16 and not model.fc2.fp8_config.fwd.is_bf16
    assert "fc2/wgrad" not in applied.pass_units() and not applied.demote_pass("fc2", "wgrad", "x")
    applied.use_units(applied.pass_units())
    assert model.fc2.fp8_config.wgrad.is_bf16  # a demoted pass stays demoted
    assert applied.demote_pass("fc2", "fwd", "test") and applied.demote_pass("fc2", "dgrad", "t")
    assert model.fc2 is originals["fc2"] and "fc2" in applied.demoted


def test_pass_level_verification_keeps_a_sites_forward_and_demotes_its_losing_pass() -> None:
    torch.manual_seed(0)
    model = Tiny()
    applied = apply(model, tiny_plan(model))
    step_fn = sgd_step(model)

    def live() -> list[str]:  # the units in FP8 in the model now
        return [f"{s}/{p}" for s in applied.active
                for p, c in model.get_submodule(s).fp8_config.passes().items() if not c.is_bf16]  # fmt: skip

    factors = dict.fromkeys(applied.pass_units(), 0.99) | {"fc1/dgrad": 1.2}
    fake = FakeStep(factors)
    fake.time = lambda: 0.1 * math.prod(factors[u] for u in live())
    config = VerifyConfig(steps_per_block=2, drop=1, blocks=3, max_rounds=8, unit="pass")
    result = verify(step_fn, applied, config, fake)
    assert list(result.demoted) == ["fc1/dgrad"] and "fc1/fwd" in result.kept
    assert result.speedup == pytest.approx(0.99**-5)
    fc1 = model.fc1.fp8_config
    assert type(model.fc1) is Fp8Linear and fc1.dgrad.is_bf16 and not fc1.fwd.is_bf16
    assert applied.demoted_passes["fc1/dgrad"].startswith("verify: ") and not applied.demoted
    with pytest.raises(ValueError, match="unit must be"):
        VerifyConfig(unit="layer")
