"""apply(model, plan): checks, fallbacks, undo, bad input; and the runtime guard."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # FP8 passes run in Triton's interpreter

import copy
import warnings

import polars as pl
import pytest
import torch
from torch import nn

import loka.zoo as zoo
from loka.dispatch.apply_plan import ApplyConfig, PlanFallbackWarning, PlanMismatchError, apply
from loka.dispatch.integrations.guard import GuardConfig, RuntimeGuard
from loka.dispatch.planner import PlanConfig, make_plan
from loka.dispatch.tables import read_plan
from loka.dispatch.testing import synthetic_kernel_bench
from loka.mods.fp8_linear import Fp8Linear
from loka.schema import PASSES, SchemaError, validate

ROW = "e4m3:e4m3/row/dynamic"


def probe_like_tables(model: nn.Module, M: int = 32) -> tuple[pl.DataFrame, pl.DataFrame]:
    """sites and site_errors for every nn.Linear, every recipe safe (as Probe would write)."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    sites = pl.DataFrame(
        [{"site": n, "kind": "linear", "K": m.in_features, "N": m.out_features, "M_min": M,
          "M_p50": M, "M_max": M, "calls": 1, "groups": 1, "has_bias": m.bias is not None,
          "dtype": "float32", "fwd_ms": None, "bwd_ms": None, "time_share": None}
         for n, m in linears],
        schema_overrides={"fwd_ms": pl.Float64, "bwd_ms": pl.Float64, "time_share": pl.Float64},
    )  # fmt: skip
    errors = pl.DataFrame(
        [{"site": n, "recipe": ROW, "pass": p, "n": 8, "mean_rel_err": 0.035, "std_rel_err": 0.001,
          "lcb_rel_err": 0.034, "ucb_rel_err": 0.036, "sqnr_db": 29.0, "max_abs_err": 0.1,
          "bf16_rel_err": 0.003, "budget": 0.06 if p == "fwd" else 0.09, "confidence": 0.95,
          "method": "student-t", "verdict": "safe", "emulated": True, "step_last": 7}
         for n, _ in linears for p in PASSES]
    )  # fmt: skip
    return validate(sites, "sites"), validate(errors, "site_errors")


def fc1_plan(model: nn.Module):
    """A plan putting the two blocks.i.fc1 (K=32, N=64) in FP8, everything else in bf16."""
    sites, errors = probe_like_tables(model)
    return make_plan(sites, errors, synthetic_kernel_bench([(32, 32, 64)]))


@pytest.fixture
def dhen():
    torch.manual_seed(0)
    return zoo.create("dhen", "tiny", seed=1, batch_size=32)  # small M: the interpreter is slow


def _outputs(setup) -> torch.Tensor:
    setup.model.eval()
    with torch.no_grad():
        return setup.model(setup.eval_batches(1)[0])


def _types(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules()}


def test_apply_converts_the_planned_sites_and_undo_restores_them(dhen, tmp_path) -> None:
    plan = fc1_plan(dhen.model)
    assert plan.fp8_sites() == ["blocks.0.fc1", "blocks.1.fc1"]
    before, originals = _outputs(dhen), {n: dhen.model.get_submodule(n) for n in plan.fp8_sites()}
    path = plan.write(tmp_path / "plan.parquet")
    applied = apply(dhen.model, path)  # from the file: schema checked on read
    assert applied.sites == ["blocks.0.fc1", "blocks.1.fc1"] and applied.fallbacks == {}
    for name in applied.sites:
        module = dhen.model.get_submodule(name)
        assert type(module) is Fp8Linear and module.weight is originals[name].weight
        assert str(module.fp8_config.fwd.recipe) == ROW
    fp8 = _outputs(dhen)
    rel = ((fp8 - before).norm() / before.norm()).item()
    assert 0 < rel < 0.1  # FP8 changed the numbers, by about FP8's error
    # It trains: the optimizer built on the original Parameters keeps working.
    dhen.model.train()
    losses = zoo.train(dhen, 2)
    assert all(torch.isfinite(torch.tensor(losses)))
    applied.undo()
    for name, module in originals.items():
        assert dhen.model.get_submodule(name) is module
    with pytest.raises(RuntimeError, match="already undone"):
        applied.undo()


def test_a_plan_for_another_model_is_refused_and_nothing_changes(dhen) -> None:
    other = zoo.create("dlrm", "tiny")
    plan = make_plan(*probe_like_tables(other.model), synthetic_kernel_bench([(32, 367, 64)]))
    state, types = copy.deepcopy(dhen.model.state_dict()), _types(dhen.model)
    with pytest.raises(PlanMismatchError, match="another model") as err:
        apply(dhen.model, plan)
    assert "fingerprint" in str(err.value) and "top.0" in str(err.value)
    assert _types(dhen.model) == types
    for k, v in dhen.model.state_dict().items():
        assert torch.equal(v, state[k])


def test_a_mismatched_site_falls_back_or_fails_when_strict(dhen) -> None:
    plan = fc1_plan(dhen.model)
    # Pretend the plan was made for a wider blocks.1.fc1.
    table = plan.table.with_columns(
        pl.when(pl.col("site") == "blocks.1.fc1").then(48).otherwise(pl.col("K")).alias("K")
    )
    plan.table = table
    types = _types(dhen.model)
    with pytest.raises(PlanMismatchError, match=r"blocks\.1\.fc1.*K=48"):
        apply(dhen.model, plan, ApplyConfig(strict=True))
    assert _types(dhen.model) == types
    with pytest.warns(PlanFallbackWarning, match=r"blocks\.1\.fc1.*stays bf16"):
        applied = apply(dhen.model, plan)
    assert applied.sites == ["blocks.0.fc1"] and "K=48" in applied.fallbacks["blocks.1.fc1"]
    assert type(dhen.model.get_submodule("blocks.1.fc1")) is nn.Linear
    applied.undo()


def test_filters_and_unrunnable_backends(dhen) -> None:
    sites, errors = probe_like_tables(dhen.model)
    gpu_only = make_plan(
        sites, errors, synthetic_kernel_bench([(32, 32, 64)], backend="torch.scaled_mm")
    )
    with pytest.warns(PlanFallbackWarning, match="torch.scaled_mm.*using triton"):
        applied = apply(dhen.model, gpu_only, ApplyConfig(emulate_on_cpu=False))
    assert dhen.model.get_submodule("blocks.0.fc1").fp8_config.fwd.backend.startswith("triton")
    applied.undo()
    with pytest.warns(PlanFallbackWarning, match="does not run on CPU"):
        kept = apply(
            dhen.model,
            gpu_only,
            ApplyConfig(replace_unrunnable_backends=False, emulate_on_cpu=False),
        )
    assert kept.sites == [] and _types(dhen.model)["blocks.0.fc1"] is nn.Linear
    only_first = apply(dhen.model, fc1_plan(dhen.model),
                       ApplyConfig(module_filter_fn=lambda m, name: name.startswith("blocks.0")))  # fmt: skip
    assert only_first.sites == ["blocks.0.fc1"]
    assert only_first.fallbacks == {"blocks.1.fc1": "excluded by module_filter_fn"}
    only_first.undo()


def test_a_plan_table_of_another_schema_version_is_refused(dhen, tmp_path) -> None:
    path = fc1_plan(dhen.model).write(tmp_path / "plan.parquet")
    footer = {**pl.read_parquet_metadata(path), "loka.schema_version": "99"}
    footer.pop("loka.checksum")  # rewritten by polars: no loka-schema checksum of its bytes
    pl.read_parquet(path).write_parquet(path, metadata=footer)  # as a future LoKA would
    types = _types(dhen.model)
    with pytest.raises(SchemaError, match="schema version 99"):
        apply(dhen.model, path)
    with pytest.raises(SchemaError, match="version 99"):
        read_plan(path)
    assert _types(dhen.model) == types


def test_guard_demotes_a_site_that_produces_nonfinite_values(dhen) -> None:
    applied = apply(dhen.model, fc1_plan(dhen.model))
    guard = RuntimeGuard(applied, GuardConfig(check_every=1))
    guard.arm(0)
    site = dhen.model.get_submodule("blocks.1.fc1")
    forward = site.forward
    site.forward = lambda x: forward(x) * float("inf")  # an overflow inside the site
    optimizer = torch.optim.SGD(dhen.model.parameters(), lr=0.0)
    batch = next(dhen.train_batches())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = dhen.loss(dhen.model, batch)
        loss.backward()
    optimizer.step()
    events = guard.step(0)
    demoted = [e for e in events if e.action == "demoted"]
    assert [e.site for e in demoted] == ["blocks.1.fc1"]
    assert "non-finite values from finite inputs" in demoted[0].reason
    assert type(dhen.model.get_submodule("blocks.1.fc1")) is nn.Linear
    assert "blocks.1.fc1" in applied.demoted and applied.sites == ["blocks.0.fc1", "blocks.1.fc1"]
    # Downstream sites saw non-finite inputs: observed, not blamed.
    assert all(e.site != "blocks.0.fc1" for e in demoted)
    # Error drift found by a re-probe demotes too.
    _, errors = probe_like_tables(dhen.model)
    drifted = errors.with_columns(
        pl.when(pl.col("site") == "blocks.0.fc1").then(pl.lit("unsafe")).otherwise(pl.col("verdict")).alias("verdict"),
        pl.when(pl.col("site") == "blocks.0.fc1").then(0.2).otherwise(pl.col("ucb_rel_err")).alias("ucb_rel_err"),
    )  # fmt: skip
    events = guard.check_errors(drifted, 5)
    assert [e.site for e in events] == ["blocks.0.fc1"] and "error drift" in events[0].reason
    applied.undo()
    assert all(t is not Fp8Linear for t in _types(dhen.model).values())


def test_a_plan_that_fuses_a_norm_needs_the_sample_and_gets_the_fused_module(dhen) -> None:
    from loka.mods.norm_linear import NormLinear

    sites, errors = probe_like_tables(dhen.model)
    bench = synthetic_kernel_bench([(32, 32, 64)], fp8_ms=0.97, norm_shapes=[(32, 32)])
    config = PlanConfig(exclude=("blocks.1.*",))
    norms = {"blocks.0.fc1": "blocks.0.norm", "blocks.1.fc1": "blocks.1.norm"}  # as Probe finds
    sites = sites.with_columns(pl.col("site").replace_strict(norms, default=None).alias("norm"))
    plan = make_plan(sites, errors, bench, config)
    assert plan.table.filter(pl.col("fuse_norm"))["site"].to_list() == ["blocks.0.fc1"]
    with pytest.warns(PlanFallbackWarning, match="pass sample="):
        skipped = apply(dhen.model, plan)
    assert skipped.sites == [] and type(dhen.model.blocks[0].fc1) is nn.Linear
    applied = apply(dhen.model, plan, sample=next(dhen.train_batches()))
    assert applied.sites == ["blocks.0.fc1"] and type(dhen.model.blocks[0].fc1) is NormLinear
    applied.undo()
    assert type(dhen.model.blocks[0].fc1) is nn.Linear


def test_a_saved_plan_carries_its_demotions_and_apply_makes_them_again(dhen, tmp_path) -> None:
    applied = apply(dhen.model, fc1_plan(dhen.model))
    assert applied.sites == ["blocks.0.fc1", "blocks.1.fc1"]
    assert applied.demote_pass("blocks.0.fc1", "wgrad", "verify: slower")
    assert applied.demote("blocks.1.fc1", "step 7: forward output non-finite")
    applied.record_demotions()
    applied.plan.write(tmp_path / "plan.parquet")
    fresh = zoo.create("dhen", "tiny", seed=1, batch_size=32)
    again = apply(fresh.model, read_plan(tmp_path / "plan.parquet"))
    assert again.demoted == {"blocks.1.fc1": "step 7: forward output non-finite"}
    assert again.demoted_passes == {"blocks.0.fc1/wgrad": "verify: slower"}
    assert type(fresh.model.blocks[1].fc1) is nn.Linear
    passes = fresh.model.blocks[0].fc1.fp8_config.passes()
    assert passes["wgrad"].is_bf16 and not passes["fwd"].is_bf16
    broken = read_plan(tmp_path / "plan.parquet")
    broken.metadata["demoted"] = "{not json"
    untouched = zoo.create("dhen", "tiny", seed=1, batch_size=32).model
    with pytest.raises(PlanMismatchError, match="recorded demotions are unreadable"):
        apply(untouched, broken)
    assert not any(isinstance(m, Fp8Linear) for m in untouched.modules())  # read first


class _FsdpMixin:
    """Stands in for FSDP2's FSDPModule: what `loka.mods.sharding` reads of a wrapped class."""

    _orig_cls_mro_index = 2


def test_an_fsdp_managed_site_applies_its_fp8_passes_in_place_without_the_norm_fusion(dhen) -> None:
    sites, errors = probe_like_tables(dhen.model)
    bench = synthetic_kernel_bench([(32, 32, 64)], fp8_ms=0.97, norm_shapes=[(32, 32)])
    sites = sites.with_columns(
        pl.col("site").replace_strict({"blocks.0.fc1": "blocks.0.norm"}, default=None).alias("norm")
    )
    plan = make_plan(sites, errors, bench, PlanConfig(exclude=("blocks.1.*",)))
    assert plan.table.filter(pl.col("fuse_norm"))["site"].to_list() == ["blocks.0.fc1"]
    linear = dhen.model.blocks[0].fc1
    linear.__class__ = type("FSDPLinear", (_FsdpMixin, nn.Linear), {})  # as fully_shard does
    with pytest.warns(PlanFallbackWarning, match="FSDP .fully_shard. manages it"):
        applied = apply(dhen.model, plan, sample=next(dhen.train_batches()))
    assert applied.sites == ["blocks.0.fc1"] and dhen.model.blocks[0].fc1 is linear
    assert isinstance(linear, Fp8Linear) and isinstance(linear, _FsdpMixin)
    assert type(dhen.model.blocks[0].norm) is nn.LayerNorm  # not fused
    applied.use([])
    assert applied.active == [] and linear.plan.all_high_precision
    applied.use(["blocks.0.fc1"])
    assert applied.active == ["blocks.0.fc1"] and not linear.plan.all_high_precision
    applied.undo()
    assert type(linear).__name__ == "FSDPLinear" and dhen.model.blocks[0].fc1 is linear


def test_on_the_cpu_native_recipes_are_emulated_by_torch_native_and_the_rest_keep_triton(
    dhen,
) -> None:
    from loka.kernels.native import NATIVE_CPU_BACKEND

    sites, errors = probe_like_tables(dhen.model)
    plan = make_plan(
        sites, errors, synthetic_kernel_bench([(32, 32, 64)], backend="triton.fp8.tma")
    )
    linear = dhen.model.get_submodule("blocks.0.fc1")
    x = torch.randn(32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanFallbackWarning)  # runnable: no fallback warning
        applied = apply(dhen.model, plan)
    assert applied.emulated == applied.sites == ["blocks.0.fc1", "blocks.1.fc1"]
    assert "2 emulated on the CPU by torch.native" in applied.summary()
    module = dhen.model.get_submodule("blocks.0.fc1")
    passes = module.fp8_config.passes()
    assert {p.backend for p in passes.values() if not p.is_bf16} == {NATIVE_CPU_BACKEND}
    assert module.native_plan is not None
    # The same quantization and products as the planned Triton kernels (run interpreted).
    emulated_y = module(x).float()
    applied.undo()
    assert dhen.model.get_submodule("blocks.0.fc1") is linear
    planned = apply(dhen.model, plan, ApplyConfig(emulate_on_cpu=False))
    triton_module = dhen.model.get_submodule("blocks.0.fc1")
    assert triton_module.native_plan is None and planned.emulated == []
    torch.testing.assert_close(emulated_y, triton_module(x).float(), rtol=1e-2, atol=1e-2)
    planned.undo()
    # Block scales have no native path: those sites keep the planned (Triton) backend.
    block = errors.with_columns(recipe=pl.lit("e4m3:e4m3/block/dynamic"))
    bench = synthetic_kernel_bench([(32, 32, 64)], dict.fromkeys(PASSES, "e4m3:e4m3/block/dynamic"))
    kept = apply(dhen.model, make_plan(sites, block, bench))
    assert kept.sites and kept.emulated == []
    assert dhen.model.get_submodule("blocks.0.fc1").fp8_config.fwd.backend.startswith("triton")


def test_guard_watches_gradients_without_torchs_full_backward_hook_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    sites, errors = probe_like_tables(model)
    plan = make_plan(sites, errors, synthetic_kernel_bench([(32, 32, 64), (32, 64, 32)]))
    applied = apply(model, plan)
    assert applied.sites == ["0", "2"]
    guard = RuntimeGuard(applied, GuardConfig(check_every=1))
    guard.arm(0)
    x = torch.randn(32, 32)  # needs no gradient: site "0" has no grad_input
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's full backward hook warned here every step
        model(x).sum().backward()
    flags = guard._flags.read(["0", "2"], torch.device("cpu"))
    assert not any(flags.values())
    assert ("0", "grad_output") in guard._flags.values and (
        "0",
        "grad_input",
    ) not in guard._flags.values
    assert ("2", "grad_input") in guard._flags.values  # site 2's own dgrad is watched
    guard.arm(1)
    model.zero_grad()
    (model(x) * float("inf")).sum().backward()  # a non-finite gradient into site 2
    flags = guard._flags.read(["0", "2"], torch.device("cpu"))
    assert flags[("2", "grad_output")]
    guard.disarm()
    applied.undo()


def test_probe_tables_alone_plan_and_apply_a_fused_norm_with_no_trace(monkeypatch) -> None:
    """Probe writes the norm feeding fc1 into `sites`; the plan weighs fusing it from the
    tables alone, and apply fuses it without tracing the model (loka.mods checks the fused
    model's outputs on the sample instead)."""
    import importlib
    import importlib.util
    from pathlib import Path

    # The model of test_dispatch_verify (norm -> fc1 -> relu -> fc2), loaded by path: with
    # --import-mode=importlib the tests folder is not on sys.path.
    spec = importlib.util.spec_from_file_location(
        "dispatch_verify_tests", Path(__file__).with_name("test_dispatch_verify.py")
    )
    verify_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verify_tests)
    Tiny = verify_tests.Tiny

    from loka.dispatch.bench import site_norm_shapes
    from loka.mods.norm_linear import NormLinear
    from loka.probe import Probe, ProbeConfig

    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(32, 32)
    with Probe(model, ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None)) as probe:
        model(x).sum().backward()
        probe.step()
        sites = probe.tables()["sites"]
    assert dict(zip(sites["site"], sites["norm"], strict=True)) == {"fc1": "norm", "fc2": None}

    def no_trace(*args, **kwargs):
        raise AssertionError("the model was traced again")

    monkeypatch.setattr(
        importlib.import_module("loka.mods.apply"), "trace_norm_consumers", no_trace
    )
    _, errors = probe_like_tables(model)
    assert site_norm_shapes(sites) == [(32, 32)]
    bench = synthetic_kernel_bench(
        [(32, 32, 64), (32, 64, 32)], fp8_ms=0.97, norm_shapes=site_norm_shapes(sites)
    )
    plan = make_plan(sites, errors, bench)
    fwd = plan.table.filter((pl.col("site") == "fc1") & (pl.col("pass") == "fwd")).row(
        0, named=True
    )
    assert fwd["fuse_norm"] and fwd["norm"] == "norm"
    applied = apply(model, plan, sample=x)
    assert applied.sites == ["fc1"] and type(model.fc1) is NormLinear
    applied.undo()


def test_a_site_loka_mods_refuses_stays_bf16_and_the_rest_is_applied_in_one_retry(
    monkeypatch,
) -> None:
    """loka.mods names the site it refuses (here: fusing a norm whose output also feeds a
    residual), so apply keeps it in bf16 and applies the rest, without trying site by site."""
    import loka.dispatch.apply_plan as apply_plan

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            return self.fc2(self.fc1(h) + h)

    torch.manual_seed(0)
    model, x = Residual(), torch.randn(32, 32)
    sites, errors = probe_like_tables(model)
    sites = sites.with_columns(  # a table that missed the residual (hooks cannot see it)
        pl.when(pl.col("site") == "fc1").then(pl.lit("norm")).otherwise(None).alias("norm")
    )
    bench = synthetic_kernel_bench([(32, 32, 32)], fp8_ms=0.97, norm_shapes=[(32, 32)])
    plan = make_plan(sites, errors, bench, PlanConfig(min_speedup=1.0))
    assert plan.table.filter(pl.col("fuse_norm"))["site"].to_list() == ["fc1"]
    assert set(plan.fp8_sites()) == {"fc1", "fc2"}
    calls = []
    real = apply_plan.mods_apply

    def counted(model, spec, sample):
        calls.append(sorted(spec.sites))
        return real(model, spec, sample)

    monkeypatch.setattr(apply_plan, "mods_apply", counted)
    with pytest.warns(PlanFallbackWarning, match="also feeds something other than the linear"):
        applied = apply(model, plan, sample=x)
    assert calls == [["fc1", "fc2"], ["fc2"]]
    assert applied.sites == ["fc2"] and "fc1" in applied.fallbacks
    assert type(model.fc1) is nn.Linear and isinstance(model.fc2, Fp8Linear)
    with pytest.raises(PlanMismatchError, match=r"loka\.mods refused the plan"):
        apply(Residual(), plan, ApplyConfig(strict=True), sample=x)


def test_an_inference_plan_prequantizes_its_weights_for_serving(dhen) -> None:
    sites, errors = probe_like_tables(dhen.model)
    bench = synthetic_kernel_bench([(32, 32, 64)], backend="torch.native")
    batch = dhen.eval_batches(1)[0]
    training = apply(dhen.model, make_plan(sites, errors, bench, PlanConfig(mode="compiled")))
    assert training.sites and training.prequantized == []
    training.undo()
    plan = make_plan(sites, errors, bench, PlanConfig(mode="compiled", inference=True))
    assert plan.metadata["inference"] == "True"
    dhen.model.eval()
    with torch.no_grad():
        per_call = apply(copy.deepcopy(dhen.model), plan, ApplyConfig(prequantize_weights=False))
        want = per_call.model(batch)
        applied = apply(dhen.model, plan)
        assert applied.prequantized == applied.sites == ["blocks.0.fc1", "blocks.1.fc1"]
        assert "2 with the weight prequantized for serving" in applied.summary()
        assert torch.equal(dhen.model(batch), want)
    # Training again needs the serving copies dropped; it says so rather than train on them.
    dhen.model.train()
    with pytest.raises(RuntimeError, match="prequantized for serving"):
        dhen.model(batch)
    assert applied.release_prequantized() == applied.sites and applied.prequantized == []
    dhen.model(batch)


def test_served_sites_take_static_input_scales_from_calibration_batches(dhen) -> None:
    sites, errors = probe_like_tables(dhen.model)
    bench = synthetic_kernel_bench([(32, 32, 64)], backend="torch.native")
    training = apply(dhen.model, make_plan(sites, errors, bench, PlanConfig(mode="compiled")))
    with pytest.raises(ValueError, match="no prequantized FP8 site to calibrate"):
        training.calibrate_input_scales(dhen.eval_batches(1))
    training.undo()
    plan = make_plan(sites, errors, bench, PlanConfig(mode="compiled", inference=True))
    dhen.model.eval()
    calibration, served = dhen.eval_batches(3)[:2], dhen.eval_batches(3)[2]
    with torch.no_grad():
        applied = apply(dhen.model, plan)
        dynamic = dhen.model(served)
        amax = applied.calibrate_input_scales(calibration, margin=2.0)
        assert sorted(amax) == applied.prequantized and all(a > 0 for a in amax.values())
        for site, value in amax.items():
            assert dhen.model.get_submodule(site).static_input_amax == pytest.approx(value)
        static = dhen.model(served)
    assert not torch.equal(static, dynamic)  # other scales, so other rounding
    assert (static - dynamic).norm() <= 0.05 * dynamic.norm()
    applied.release_prequantized()
    assert all(dhen.model.get_submodule(s).static_input_amax is None for s in amax)
    applied.undo()
    with pytest.raises(RuntimeError, match="undone"):
        applied.calibrate_input_scales(calibration)


def test_bias_gradient_form_is_an_apply_option_with_the_same_gradients(dhen) -> None:
    # ApplyConfig.bias_grad="gemm": every FP8 site sums dY for its bias on the tensor cores
    # (ones @ dY) instead of a reduction over the tokens; the gradients agree with "sum".
    sites, errors = probe_like_tables(dhen.model)
    plan = make_plan(sites, errors, synthetic_kernel_bench([(32, 32, 64)]))
    x = torch.randn(32, 32)

    def bias_grads(config: ApplyConfig | None) -> tuple[list[str], dict[str, torch.Tensor]]:
        applied = apply(dhen.model, plan, config)
        modules = {s: dhen.model.get_submodule(s) for s in applied.sites}
        forms = [m.fp8_config.bias_grad for m in modules.values()]
        grads = {}
        for site, module in modules.items():
            module.zero_grad()
            module(x).square().sum().backward()
            grads[site] = module.bias.grad.clone()
        applied.undo()
        return forms, grads

    forms, by_sum = bias_grads(None)
    assert forms and set(forms) == {"sum"}
    forms, by_gemm = bias_grads(ApplyConfig(bias_grad="gemm"))
    assert set(forms) == {"gemm"} and by_gemm.keys() == by_sum.keys()
    for site in by_sum:
        torch.testing.assert_close(by_gemm[site], by_sum[site], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias_grad must be one of"):
        apply(dhen.model, plan, ApplyConfig(bias_grad="dot"))


def test_eager_graphs_are_an_apply_option(dhen) -> None:
    # ApplyConfig.eager_graphs=False: every FP8 site's config says no CUDA graphs in eager
    # mode (`loka.mods.eager_graphs`); the default keeps them.
    sites, errors = probe_like_tables(dhen.model)
    plan = make_plan(sites, errors, synthetic_kernel_bench([(32, 32, 64)]))
    for config, want in ((None, True), (ApplyConfig(eager_graphs=False), False)):
        applied = apply(dhen.model, plan, config)
        flags = {dhen.model.get_submodule(s).fp8_config.eager_graphs for s in applied.sites}
        applied.undo()
        assert flags == {want}


def test_a_plan_takes_the_centered_forward_where_the_plain_one_is_unsafe_and_applies_it(
    dhen,
) -> None:
    # Probe's rows for a collapsed site: the plain rowwise forward unsafe for its varying
    # error, the centered one safe; the bench times both (centered a little slower).
    center = ROW + "/center"
    sites, errors = probe_like_tables(dhen.model)
    fwd = (pl.col("pass") == "fwd") & pl.col("site").str.ends_with("fc1")
    errors = errors.with_columns(
        pl.when(fwd).then(pl.lit("unsafe")).otherwise(pl.col("verdict")).alias("verdict"),
        pl.when(fwd).then(0.6).otherwise(pl.col("ucb_rel_err")).alias("ucb_rel_err"),
        pl.when(fwd).then(0.5).otherwise(pl.col("lcb_rel_err")).alias("lcb_rel_err"),
    )
    centered = errors.filter(fwd).with_columns(
        pl.lit(center).alias("recipe"), pl.lit("safe").alias("verdict"),
        pl.lit(0.02).alias("ucb_rel_err"), pl.lit(0.019).alias("lcb_rel_err"),
    )  # fmt: skip
    errors = pl.concat([errors, centered])
    fast = synthetic_kernel_bench([(32, 32, 64)], backend="torch.native")
    slower = synthetic_kernel_bench(
        [(32, 32, 64)], {"fwd": center}, backend="torch.native", fp8_ms=0.6
    ).filter(pl.col("recipe") == center)
    plan = make_plan(sites, errors, pl.concat([fast, slower]), PlanConfig(mode="compiled"))
    rows = {(r["site"], r["pass"]): r for r in plan.table.iter_rows(named=True)}
    assert rows[("blocks.0.fc1", "fwd")]["recipe"] == center
    reasons = [r["reason"] for r in rows[("blocks.0.fc1", "fwd")]["rejected"]]
    assert any(reason.startswith("unsafe") for reason in reasons)
    applied = apply(dhen.model, plan)
    module = dict(dhen.model.named_modules())["blocks.0.fc1"]
    assert isinstance(module, Fp8Linear) and module.fp8_config.fwd.recipe.center
    assert module.native_plan is not None and module.native_plan.fwd.center
    dhen.model.train()
    dhen.loss(dhen.model, next(dhen.train_batches())).backward()  # it runs, and trains
    assert module.weight.grad is not None and torch.isfinite(module.weight.grad).all()
    applied.undo()
