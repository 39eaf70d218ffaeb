"""Benchmark machinery: candidates, per-pass timing (CPU interpreter), cache, cost model."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import dataclasses

import polars as pl
import pytest
import torch

from loka.dispatch.bench.cache import BenchCache, CacheMismatchError, check_same_device
from loka.dispatch.bench.candidates import (
    Candidate,
    candidates,
    m_bucket,
    recipes_by_pass,
    speed_key,
)
from loka.dispatch.bench.cost_model import CostModel
from loka.dispatch.bench.runner import (
    Shape,
    benchmark,
    by_promise,
    mode_backends,
    site_recipes,
    site_shapes,
    timed_shape,
)
from loka.dispatch.bench.timing import NativeQuantTimes, PassTimer, QuantOperand
from loka.dispatch.device import DeviceInfo
from loka.schema import read_table, validate

H200 = DeviceInfo("NVIDIA H200", "9.0", "570.1 / CUDA 13.0", "2.11.0", "3.6.0")


def test_buckets_and_speed_keys() -> None:
    assert [m_bucket(m) for m in (1, 3, 5, 41000, 65536, 90000)] == [1, 4, 4, 32768, 65536, 65536]
    with pytest.raises(ValueError, match="positive"):
        m_bucket(0)
    assert speed_key("e4m3:e4m3/row/dynamic/pow2/ub=1024.0") == "e4m3:e4m3/row/dynamic"
    assert speed_key("e4m3:e4m3/tensor/delayed16") == speed_key("e4m3:e4m3/tensor/delayed4")
    assert speed_key("bf16") == "bf16"
    by_pass = recipes_by_pass({"fwd": ["e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic/pow2"]})
    assert [str(r) for r in by_pass["fwd"]] == ["bf16", "e4m3:e4m3/row/dynamic"]
    assert [str(r) for r in by_pass["dgrad"]] == ["bf16"]


def test_candidates_name_every_refusal() -> None:
    found = candidates(4096, 479, 1024)  # K = 479: not a multiple of 16
    refused = {
        (s.candidate.backend, s.candidate.recipe, s.candidate.pass_): s.refusal for s in found
    }
    assert "multiple of 16" in refused[("torch.scaled_mm", "e4m3:e4m3/row/dynamic", "fwd")]
    assert refused[("torch.bf16", "bf16", "fwd")] is None
    assert not any(s.candidate.fast_accum for s in found)  # opt-in only
    assert any(s.candidate.fast_accum for s in candidates(64, 64, 64, include_fast_accum=True))
    on_cpu = candidates(64, 128, 64, device="cpu")
    fp8 = [s for s in on_cpu if not s.candidate.is_bf16]
    assert fp8 and all(s.refusal for s in fp8)
    assert all("CUDA" in s.refusal for s in fp8 if s.candidate.backend == "triton.fp8")


def test_timer_computes_each_pass_as_the_fp8_linear_would() -> None:
    timer = PassTimer(32, 128, 48, "cpu")
    x, w, dy = (t.float() for t in timer.inputs())
    reference = {"fwd": x @ w.t(), "dgrad": dy @ w, "wgrad": dy.t() @ x}
    recipes = {p: ["e4m3:e4m3/row/dynamic"] for p in reference} | {
        "fwd": ["e4m3:e4m3/tensor/delayed16", "e4m3:e4m3/block/dynamic"]
    }
    statuses = candidates(32, 128, 48, recipes, device="cpu", runnable_only=True,
                          backends=["torch.bf16", "triton.fp8"])  # fmt: skip
    assert len(statuses) == 7 and all(s.refusal is None for s in statuses)
    for status in statuses:
        c = status.candidate
        ref = reference[c.pass_]
        err = ((timer.output(c).float() - ref).norm() / ref.norm()).item()
        assert err < (0.005 if c.is_bf16 else 0.06), (c, err)
    timing = timer.time(Candidate("triton.fp8", "e4m3:e4m3/row/dynamic", "wgrad"))
    assert timing.method == "wall_clock" and timing.quant_ms > 0 and timing.gemm_ms > 0
    assert timing.median_ms == pytest.approx(timing.gemm_ms + timing.quant_ms)
    assert timer.time(Candidate("torch.bf16", "bf16", "fwd")).quant_ms == 0.0


def _rows(device: DeviceInfo, n: int = 2, estimated: bool = False) -> pl.DataFrame:
    return validate(
        pl.DataFrame(
            {
                **{k: [v] * n for k, v in device.as_dict().items()},
                "backend": ["torch.bf16"] * n, "recipe": ["bf16"] * n, "pass": ["fwd"] * n,
                "M_bucket": [1024 * (i + 1) for i in range(n)], "K": [64] * n, "N": [64] * n,
                "groups": [1] * n, "median_ms": [0.01 * (i + 1) for i in range(n)],
                "tflops": [1.0] * n, "estimated": [estimated] * n,
            }
        ),
        "kernel_bench",
    )  # fmt: skip


def test_cache_round_trip_merge_and_foreign_files(tmp_path) -> None:
    cache = BenchCache(tmp_path)
    assert cache.load(H200).is_empty()
    cache.store(H200, _rows(H200, 2))
    newer = _rows(H200, 3).with_columns(pl.col("median_ms") * 10)
    cache.store(H200, newer)
    loaded = cache.load(H200)
    assert loaded.height == 3 and loaded["median_ms"].to_list() == pytest.approx([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="estimated"):
        cache.store(H200, _rows(H200, 1, estimated=True))

    other = dataclasses.replace(H200, device="NVIDIA H100", driver="550.0 / CUDA 12.4")
    with pytest.raises(CacheMismatchError, match="rows to cache"):
        cache.store(H200, _rows(other))
    cache.store(other, _rows(other))
    assert cache.others(H200) == [other]
    # A file moved or copied from another machine is refused with what differs.
    cache.path(other).replace(cache.path(H200))
    with pytest.raises(CacheMismatchError) as err:
        cache.load(H200)
    message = str(err.value)
    assert "NVIDIA H100" in message and "driver" in message and "this machine" in message
    with pytest.raises(CacheMismatchError, match="torch_version"):
        check_same_device(_rows(dataclasses.replace(H200, torch_version="2.9")), H200, "t")


def test_cost_model_reproduces_recorded_rows_and_reports_its_error() -> None:
    model = CostModel.shipped()
    row = model.table.filter(
        (pl.col("backend") == "torch.scaled_mm") & (pl.col("pass") == "dgrad")
    ).row(0, named=True)
    c = Candidate(row["backend"], row["recipe"], row["pass"])
    est = model.estimate(c, row["M_bucket"], row["K"], row["N"])
    assert est.median_ms == pytest.approx(row["median_ms"], rel=1e-6)
    assert est.method == "cost_model"
    bigger = model.estimate(c, 4 * row["M_bucket"], row["K"], row["N"])
    assert bigger.median_ms > est.median_ms
    assert model.estimate(Candidate("no.such", "bf16", "fwd"), 64, 64, 64) is None
    holdout = model.holdout()
    err = holdout["rel_err"].abs()
    # The documented leave-one-out error of the shipped table (README): median 7.3%,
    # 90th percentile 30%, the worst at the zoo's skinny shapes (K or N < 256).
    assert err.median() < 0.09 and err.quantile(0.9) < 0.35


def test_benchmark_without_a_gpu_estimates_and_says_so() -> None:
    with pytest.raises(ValueError, match="cost model"):
        benchmark([Shape(8192, 1024, 4096)], device="cpu")
    result = benchmark([Shape(8192, 1024, 4096), Shape(16384, 512, 512)],
                       cost_model=CostModel.shipped(), device="cpu")  # fmt: skip
    assert result.measured == 0 and result.estimated == result.table.height > 20
    assert result.table["estimated"].all() and set(result.table["device"]) == {"NVIDIA H200"}
    assert any("ESTIMATE" in note for note in result.notes)


def test_benchmark_measures_then_reuses_its_cache(tmp_path) -> None:
    cache = BenchCache(tmp_path)
    recipes = {"fwd": ["e4m3:e4m3/row/dynamic"], "dgrad": [], "wgrad": []}
    kw = dict(recipes=recipes, cache=cache, time_on_cpu=True)
    first = benchmark([Shape(32, 128, 64)], norm_shapes=[(32, 128)], **kw)
    # bf16 x 3 passes + the row recipe on every runnable FP8 backend (Triton, interpreted),
    # and the LayerNorm and fused norm+quantize rows of the norm (N = 0).
    assert first.measured == first.table.height >= 6 and first.reused == 0
    norms = first.table.filter(pl.col("N") == 0)
    assert sorted(norms["backend"]) == ["loka.norm_quantize", "torch.layer_norm"]
    assert not first.table["estimated"].any()
    second = benchmark([Shape(32, 128, 64)], norm_shapes=[(32, 128)], **kw)
    assert second.measured == 0 and second.reused == first.measured
    assert second.table.sort("backend", "pass").equals(first.table.sort("backend", "pass"))
    assert (
        read_table(cache.path(DeviceInfo.current("cpu")), "kernel_bench").height == first.measured
    )
    # Past the budget nothing more is measured; without a cost model of this device the
    # rest is reported, not invented.
    late = benchmark([Shape(64, 128, 64)], budget_s=0.0, **kw)
    assert late.measured == 0 and late.table.is_empty() and late.failed
    assert any("budget" in note for note in late.notes)


def test_cached_baselines_are_timed_again_and_the_faster_kept(tmp_path, monkeypatch) -> None:
    import loka.dispatch.bench.runner as runner

    cache = BenchCache(tmp_path)
    recipes = {"fwd": ["e4m3:e4m3/row/dynamic"], "dgrad": [], "wgrad": []}
    kw = dict(recipes=recipes, cache=cache, time_on_cpu=True)
    first = benchmark([Shape(32, 128, 64)], **kw)
    baseline = {
        r["pass"]: r["median_ms"] for r in first.table.filter(pl.col("recipe") == "bf16").rows(
            named=True)
    }  # fmt: skip
    # One session read the forward's baseline 30% slow and the dgrad's 30% fast; the next
    # bench times every baseline again.
    now = {"fwd": baseline["fwd"] / 1.3, "dgrad": baseline["dgrad"] * 1.3,
           "wgrad": baseline["wgrad"] * 1.01}  # fmt: skip
    calls = []

    def fake_time(timer, c):
        calls.append(c)
        ms = now[c.pass_]
        return runner.PassTiming(ms, ms, 0.0, "wall_clock")

    # Each cached FP8 row's GEMM is timed again too (its quantization kept): here the
    # first FP8 row reads 20% faster, every other one 10% slower.
    fp8_first = first.table.filter(pl.col("recipe") != "bf16").row(0, named=True)
    gemm_calls = []

    def fake_gemm(timer, c):
        gemm_calls.append(c)
        cached = first.table.filter(
            (pl.col("backend") == c.backend) & (pl.col("recipe") == c.recipe)
            & (pl.col("pass") == c.pass_)
        ).row(0, named=True)["gemm_ms"]  # fmt: skip
        same = (c.backend, c.recipe, c.pass_) == tuple(
            fp8_first[k] for k in ("backend", "recipe", "pass")
        )
        return cached * (0.8 if same else 1.1)

    monkeypatch.setattr(runner, "_time", fake_time)
    monkeypatch.setattr(runner, "_time_gemm", fake_gemm)
    second = benchmark([Shape(32, 128, 64)], retime_baselines=True, **kw)
    assert {c.pass_ for c in calls} == {"fwd", "dgrad", "wgrad"} and all(c.is_bf16 for c in calls)
    assert second.measured == 0 and second.retimed == 3 and second.reused == first.measured
    n_fp8 = first.table.filter(pl.col("recipe") != "bf16").height
    assert second.retimed_fp8 == n_fp8 == len(gemm_calls) and not any(c.is_bf16 for c in gemm_calls)
    got = {r["pass"]: r["median_ms"] for r in second.table.filter(pl.col("recipe") == "bf16")
           .rows(named=True)}  # fmt: skip
    # The faster of the two readings: the forward's new one, the others' cached ones.
    assert got == {"fwd": now["fwd"], "dgrad": baseline["dgrad"], "wgrad": baseline["wgrad"]}
    (note,) = [n for n in second.notes if "bf16 baseline(s) re-timed" in n]
    assert note.startswith("2 of 3 cached bf16 baseline(s)") and "1 faster now" in note
    assert "1 slower" in note and "the largest: 32x128x64 fwd" in note
    # The cache keeps the faster reading; FP8 rows are reused as they were.
    stored = read_table(cache.path(DeviceInfo.current("cpu")), "kernel_bench")
    fwd = stored.filter((pl.col("recipe") == "bf16") & (pl.col("pass") == "fwd"))
    assert fwd["median_ms"].to_list() == [now["fwd"]] and stored.height == first.measured
    # The FP8 row read faster keeps its new GEMM time plus its cached quantization time;
    # the others are reused as they were.
    keys = ["backend", "recipe", "pass"]
    fp8 = second.table.filter(pl.col("recipe") != "bf16").sort(keys)
    was = first.table.filter(pl.col("recipe") != "bf16").sort(keys)
    changed = [(a, b) for a, b in zip(fp8.rows(named=True), was.rows(named=True), strict=True)
               if a != b]  # fmt: skip
    ((new, old),) = changed
    assert new["gemm_ms"] == pytest.approx(0.8 * old["gemm_ms"])
    assert new["median_ms"] == pytest.approx(new["gemm_ms"] + old["quant_ms"])
    (fp8_note,) = [n for n in second.notes if "FP8 GEMM(s)" in n]
    assert fp8_note.startswith(f"{n_fp8} of {n_fp8} cached FP8 GEMM(s)")
    assert "1 faster now" in fp8_note
    # Off (the CPU's default: wall clocks there check machinery) nothing is timed again.
    calls.clear()
    gemm_calls.clear()
    third = benchmark([Shape(32, 128, 64)], **kw)
    assert calls == gemm_calls == [] and third.retimed == third.retimed_fp8 == 0


def test_cached_host_times_are_measured_again(tmp_path, monkeypatch) -> None:
    """An eager FP8 row's host time is this process's: a later bench re-measures it (the
    host's speed moves between processes, and eager graphs cut it)."""
    import loka.dispatch.bench.runner as runner

    recipes = {"fwd": ["e4m3:e4m3/row/dynamic"], "dgrad": [], "wgrad": []}
    kw = dict(recipes=recipes, cache=BenchCache(tmp_path), time_on_cpu=True)
    monkeypatch.setattr(runner, "_host_ms", lambda c, shape, device: 1.0)
    first = benchmark([Shape(32, 128, 64)], **kw)
    fp8 = pl.col("recipe") != "bf16"
    assert set(first.table.filter(fp8)["host_ms"].to_list()) == {1.0}
    monkeypatch.setattr(runner, "_host_ms", lambda c, shape, device: 0.25)
    second = benchmark([Shape(32, 128, 64)], retime_baselines=True, **kw)
    assert second.measured == 0
    assert set(second.table.filter(fp8)["host_ms"].to_list()) == {0.25}
    (note,) = [n for n in second.notes if "host time" in n]
    assert "1.000 ms cached, 0.250 ms now" in note
    third = benchmark([Shape(32, 128, 64)], **kw)  # off: the cached host time stands
    assert set(third.table.filter(fp8)["host_ms"].to_list()) == {1.0}


def test_an_eager_bench_that_charges_host_time_skips_candidates_it_cannot_pick(
    tmp_path, monkeypatch
) -> None:
    """An FP8 pass whose extra host time alone is at least its bf16 pass's time loses in an
    eager plan that charges host time, whatever its GEMM: not timed, not estimated."""
    import loka.dispatch.bench.runner as runner

    recipes = {"fwd": ["e4m3:e4m3/row/dynamic"], "dgrad": [], "wgrad": []}
    kw = dict(recipes=recipes, time_on_cpu=True, backends=mode_backends("eager"))
    plain = benchmark([Shape(32, 128, 64)], **kw)
    bf16 = plain.table.filter(pl.col("recipe") == "bf16")
    fp8 = plain.table.height - bf16.height
    assert fp8 > 0 and plain.hopeless == 0

    # (wall-clock timings on the CPU move between runs: host times far off either side)
    monkeypatch.setattr(runner, "_host_ms", lambda c, shape, device: 1e3)  # loses
    charged = benchmark([Shape(32, 128, 64)], charge_host=True, **kw)
    assert charged.hopeless == fp8 and charged.estimated == 0
    assert charged.table.filter(pl.col("recipe") != "bf16").height == 0
    assert charged.measured == bf16.height  # the baselines are still timed
    (note,) = [n for n in charged.notes if "not timed" in n]
    assert note.startswith(f"{fp8} eager FP8 candidate(s) not timed: their host time alone")

    monkeypatch.setattr(runner, "_host_ms", lambda c, shape, device: 0.0)  # may win
    cheaper = benchmark([Shape(32, 128, 64)], charge_host=True, **kw)
    assert cheaper.hopeless == 0 and cheaper.table.height == plain.table.height


def test_measuring_order_gives_every_shape_its_most_promising_candidates_first() -> None:
    shapes = [Shape(4096, 1024, 4096), Shape(1024, 256, 512)]  # most important first
    plan = [(s, st) for s in shapes for st in candidates(s.M_bucket, s.K, s.N)]
    model = CostModel.shipped()
    order = by_promise(plan, model)
    assert sorted(map(id, order)) == sorted(map(id, plan))  # the same entries, reordered
    kinds = ["bf16" if st.candidate.is_bf16 else "fp8" for _, st in order]
    baselines = kinds.count("bf16")  # torch.bf16's, and inductor.bf16's (refused: aligned)
    assert baselines >= 6 and kinds[:baselines] == ["bf16"] * baselines  # baselines first
    # Then each (shape, pass)'s fastest estimate, the important shape's first, before any
    # second choice: a budget cut after 12 rows still times an FP8 candidate of each pass
    # of both shapes (shape-major order gave the first shape all 12).
    first = order[baselines : baselines + 6]
    assert [(s, st.candidate.pass_) for s, st in first] == [
        (s, p) for s in shapes for p in ("fwd", "dgrad", "wgrad")
    ]
    for shape, status in first:
        rivals = [
            model.estimate(st.candidate, s.M_bucket, s.K, s.N)
            for s, st in plan
            if s == shape and st.candidate.pass_ == status.candidate.pass_
            and not st.candidate.is_bf16
        ]  # fmt: skip
        best = min(t.median_ms for t in rivals if t is not None)
        mine = model.estimate(status.candidate, shape.M_bucket, shape.K, shape.N)
        assert mine is not None and mine.median_ms == best
    # Without a cost model: round robin in the given order.
    plain = by_promise(plan, None)
    assert [(s, st.candidate.pass_) for s, st in plain[baselines : baselines + 6]] == [
        (s, p) for s in shapes for p in ("fwd", "dgrad", "wgrad")
    ]


def test_a_budget_cut_measures_some_fp8_candidate_of_every_shape(monkeypatch) -> None:
    import loka.dispatch.bench.runner as runner

    clock = [0.0]
    timed = runner._time

    def one_second_each(timer, c):  # each measurement costs one (fake) second
        clock[0] += 1.0
        return timed(timer, c)

    monkeypatch.setattr(runner, "_time", one_second_each)
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    recipes = {"fwd": ["e4m3:e4m3/row/dynamic", "e4m3:e4m3/tensor/dynamic"], "dgrad": [],
               "wgrad": []}  # fmt: skip
    shapes = [Shape(64, 128, 64), Shape(32, 64, 128)]
    result = benchmark(shapes, recipes=recipes, time_on_cpu=True, budget_s=7.5,
                       cost_model=CostModel.shipped())  # fmt: skip
    fp8 = result.table.filter(pl.col("recipe") != "bf16")
    assert result.measured == 8 and set(zip(fp8["K"], fp8["N"], strict=True)) == {
        (128, 64),
        (64, 128),
    }


def test_the_bench_times_only_recipes_probe_measured() -> None:
    errors = pl.DataFrame(
        {"site": ["a", "a", "a", "b", "b"],
         "recipe": ["e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic/pow2",
                    "e5m2:e4m3/tensor/dynamic", "e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic"],
         "pass": ["fwd", "fwd", "dgrad", "fwd", "wgrad"]}
    )  # fmt: skip
    recipes = site_recipes(errors)
    assert recipes == {
        "fwd": ["e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic/pow2"],
        "dgrad": ["e5m2:e4m3/tensor/dynamic"],
        "wgrad": ["e4m3:e4m3/row/dynamic"],
    }
    shape = [Shape(8192, 1024, 4096)]
    everything = benchmark(shape, cost_model=CostModel.shipped(), device="cpu").table
    assert "e5m2:e4m3/row/dynamic" in set(everything["recipe"])  # the default timing list
    table = benchmark(shape, cost_model=CostModel.shipped(), device="cpu", recipes=recipes).table
    by_pass = {
        p: set(table.filter(pl.col("pass") == p)["recipe"]) for p in ("fwd", "dgrad", "wgrad")
    }
    assert by_pass == {
        "fwd": {"bf16", "e4m3:e4m3/row/dynamic"},  # pow2 shares the row recipe's timing
        "dgrad": {"bf16", "e5m2:e4m3/tensor/dynamic"},
        "wgrad": {"bf16", "e4m3:e4m3/row/dynamic"},
    }


def test_an_unaligned_site_gets_native_candidates_timed_as_they_pad() -> None:
    # InterFormer xl's fc1 (K = 7507): the native linear pads its GEMMs, so it is a
    # candidate; it is timed at the padded dims and recorded at the site's.
    native = Candidate("torch.native", "e4m3:e4m3/row/dynamic", "fwd")
    assert timed_shape(Shape(64, 7507, 4096), native) == Shape(64, 7520, 4096)
    scaled = Candidate("torch.scaled_mm", "e4m3:e4m3/row/dynamic", "fwd")
    assert timed_shape(Shape(64, 7507, 4096), scaled) == Shape(64, 7507, 4096)
    refused = {
        st.candidate.backend: st.refusal
        for st in candidates(64, 7507, 4096, {"fwd": ["e4m3:e4m3/row/dynamic"]})
        if not st.candidate.is_bf16 and st.candidate.pass_ == "fwd"
    }
    assert refused["torch.native"] is None and "multiple of 16" in refused["torch.scaled_mm"]
    recipes = {"fwd": ["e4m3:e4m3/row/dynamic"], "dgrad": [], "wgrad": []}
    result = benchmark([Shape(32, 30, 24)], recipes=recipes, time_on_cpu=True,
                       backends=["torch.bf16", "torch.native"])  # fmt: skip
    row = result.table.filter(pl.col("backend") == "torch.native")
    assert row.height == 1 and (row["K"][0], row["N"][0]) == (30, 24) and not result.failed


def test_site_shapes_dedupe_and_order_by_importance() -> None:
    sites = pl.DataFrame(
        {"site": ["a", "b", "c", "d"], "kind": ["linear", "linear", "linear", "grouped"],
         "K": [64, 64, 1024, 8], "N": [64, 64, 4096, 8], "M_p50": [1000, 1100, 4096, 8],
         "groups": [1, 1, 1, 4], "time_share": [None, None, None, None]}
    )  # fmt: skip
    assert site_shapes(sites) == [Shape(4096, 1024, 4096), Shape(1024, 64, 64)]
    timed = sites.with_columns(pl.Series("time_share", [0.3, 0.3, 0.1, 0.0]))
    assert site_shapes(timed)[0] == Shape(1024, 64, 64)


def test_device_info_of_the_cpu() -> None:
    info = DeviceInfo.current("cpu")
    assert info.device == "cpu" and info.torch_version == torch.__version__
    assert info.slug.startswith("cpu-") and info.slug != H200.slug
    assert H200.differences(dataclasses.replace(H200, triton_version="3.5.0")) == [
        "triton_version '3.5.0' (this machine: '3.6.0')"
    ]


def test_native_quant_times_measure_once_then_fit_from_the_measured() -> None:
    times = NativeQuantTimes()
    calls = []

    def measure(ms: float):
        return lambda: calls.append(ms) or ms

    row = [QuantOperand(r, 1024, 2, "row", False) for r in (1024, 4096, 16384)]
    assert times.time(row[0], measure(0.01)) == (0.01, False)
    assert times.time(row[0], measure(99.0)) == (0.01, False)  # the same operand: not again
    times.fit_only = True
    # One point of this granularity and layout is no line: it is measured after all.
    assert times.time(row[1], measure(0.03)) == (0.03, False)
    assert calls == [0.01, 0.03]
    fitted, was_fitted = times.time(row[2], measure(99.0))
    # The line through (2 MiB, 0.01) and (8 MiB, 0.03), extended to 32 MiB.
    assert was_fitted and fitted == pytest.approx(0.01 + 0.02 * (16384 - 1024) / 3072)
    assert calls == [0.01, 0.03]
    # Another layout has no points of its own: measured.
    other = QuantOperand(1024, 1024, 2, "row", True)
    assert times.time(other, measure(0.02)) == (0.02, False)
    # A falling line is not extrapolated below zero.
    flat = NativeQuantTimes()
    flat.measured = {QuantOperand(1, 10, 2, "tensor", False): 0.05,
                     QuantOperand(1, 1000, 2, "tensor", False): 0.01}  # fmt: skip
    assert flat.fit(QuantOperand(1, 10**6, 2, "tensor", False)) >= 0.0


def test_native_quantization_is_timed_per_operand_whatever_its_format(monkeypatch) -> None:
    """e4m3 and e5m2 move the same bytes: the dgrad's weight operand, shared by both recipes,
    is timed once, and so is the dY operand (only the format differs)."""
    import loka.dispatch.bench.timing as timing
    from loka.kernels.native import quantize_native
    from loka.schema import Recipe

    monkeypatch.setattr(timing, "_compiled_native_quantize", lambda: quantize_native)
    shared = NativeQuantTimes()
    timer = PassTimer(32, 64, 48, "cpu", native_quant=shared)
    e5m2 = timer.quant_ms(Recipe.parse("e5m2:e4m3/row/dynamic"), "dgrad", traceable=True)
    assert {(o.rows, o.cols, o.element_bytes, o.transpose) for o in shared.measured} == {
        (32, 48, 2, False),  # dY, bf16
        (48, 64, 4, True),  # the weight from its float32 master, transposed
    }
    e4m3 = timer.quant_ms(Recipe.parse("e4m3:e4m3/row/dynamic"), "dgrad", traceable=True)
    assert len(shared.measured) == 2 and e4m3 == e5m2 > 0
    # Another shape's timer shares the measurements through the same object.
    other = PassTimer(64, 64, 48, "cpu", native_quant=shared)
    other.quant_ms(Recipe.parse("e4m3:e4m3/row/dynamic"), "fwd", traceable=True)
    assert len(shared.measured) == 4  # x[64, 64] and W[48, 64] row-major are new


def test_a_centering_recipe_is_its_own_speed_and_runs_natively_in_fwd_and_dgrad(
    monkeypatch,
) -> None:
    import loka.dispatch.bench.timing as timing
    from loka.kernels.native import quantize_native
    from loka.schema import Recipe

    center = "e4m3:e4m3/row/dynamic/center"
    assert speed_key("e4m3:e4m3/row/dynamic/pow2/center") == center
    by_pass = recipes_by_pass(
        {"fwd": ["e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic/pow2/center"]}
    )
    assert [str(r) for r in by_pass["fwd"]] == ["bf16", "e4m3:e4m3/row/dynamic", center]
    found = candidates(4096, 1024, 512, {"fwd": [center], "dgrad": [center], "wgrad": [center]})
    refused = {(s.candidate.backend, s.candidate.pass_): s.refusal for s in found}
    assert refused[("torch.native", "fwd")] is None and refused[("torch.native", "dgrad")] is None
    assert "center is for fwd and dgrad" in refused[("torch.native", "wgrad")]
    assert "does not run a recipe's center" in refused[("torch.scaled_mm", "fwd")]
    # Timed with its mean and GEMV: an operand of its own beside the plain recipe's.
    monkeypatch.setattr(timing, "_compiled_native_quantize", lambda: quantize_native)
    monkeypatch.setattr(
        timing, "_compiled_native_centered_quantize", lambda: timing.centered_quantize
    )
    shared = NativeQuantTimes()
    timer = PassTimer(32, 64, 48, "cpu", native_quant=shared)
    plain = timer.quant_ms(Recipe.parse("e4m3:e4m3/row/dynamic"), "fwd", traceable=True)
    centered = timer.quant_ms(Recipe.parse(center), "fwd", traceable=True)
    assert plain > 0 and centered > 0
    assert {(o.rows, o.cols, o.centered) for o in shared.measured} == {
        (32, 64, False), (32, 64, True), (48, 64, False),  # x twice, the weight once
    }  # fmt: skip
