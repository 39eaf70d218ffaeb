"""CUDA graphs of the error analysis (`loka.probe.error_graphs`): the graphed analysis gives
the sums of the eager one, bit for bit; layouts are captured on their second sight,
replayed after, bounded per site; a failed capture falls back to eager.

On the CPU the graph is a stand-in that replays by running the function again into the
captured outputs' memory, which is what a CUDA graph's replay does to them; the last test
runs real graphs on a GPU."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, replace

import polars as pl
import pytest
import torch
from torch.utils._pytree import tree_leaves

import loka.zoo as zoo
from loka.probe import Probe, ProbeConfig
from loka.probe.error_graphs import MAX_PER_SITE, ErrorGraphs
from loka.probe.scaled_mm import has_fp8_gemm

QUICK = ProbeConfig(every=1, warmup_steps=0, rows=64, queue_size=64, exclude=("*projections.*",))


def standin_capture(fn, static):
    """(replay, outputs) as a CUDA capture gives them: replay overwrites `outputs`."""
    outputs = fn(static)

    def replay() -> None:
        fresh = fn(static)
        for old, new in zip(tree_leaves(outputs), tree_leaves(fresh), strict=True):
            if isinstance(old, torch.Tensor):
                old.copy_(new)
            else:
                assert old == new  # the flags a capture fixed must not change

    return replay, outputs


def _sums(probe: Probe) -> dict:
    """Every site's per-batch errors, per recipe and pass (`ErrorSeries` as a dict)."""
    probe.flush()
    out = {}
    for name, state in probe._states.items():
        for key, series in state.errors.items():
            out[(name, *key)] = asdict(series)
        for pass_, series in state.bf16.items():
            out[(name, "bf16", pass_)] = asdict(series)
    return out


def _same(a: object, b: object) -> bool:
    """Equal, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _train(
    graphs: ErrorGraphs | None, steps: int = 5, model: str = "dhen"
) -> tuple[dict, pl.DataFrame, Probe]:
    setup = zoo.create(model, "tiny", seed=1)
    probe = Probe(setup.model, replace(QUICK, error_graphs=graphs is not None))
    if graphs is not None:
        probe._analyzer.graphs = graphs
    zoo.train(setup, steps, on_step=lambda step, loss: probe.step())
    sums, errors = _sums(probe), probe.tables()["site_errors"]
    probe.attached_counters = probe.counters  # before detach() releases the graphs
    probe.detach()
    return sums, errors, probe


@pytest.mark.parametrize("model", ["dhen", "hstu"])  # HSTU: jagged, tokens vary per batch
def test_graphed_analysis_gives_the_eager_sums_bit_for_bit(model) -> None:
    graphs = ErrorGraphs(capture=standin_capture, cuda_only=False)
    got, got_table, probe = _train(graphs, model=model)
    expected, expected_table, _ = _train(None, model=model)
    assert got.keys() == expected.keys() and len(got) > 20
    for key in expected:
        assert _same(got[key], expected[key]), key
    assert got_table.equals(expected_table)
    counts = graphs.counts
    sites = len({key[0] for key in got})
    # every site: seen on step 0, captured on step 1, replayed on steps 2-4 (delayed
    # scaling's history grows over the first steps, so some layouts come later)
    assert counts.captures >= sites and counts.replays >= 2 * sites
    assert probe.counters["graph_replays"] == counts.replays
    assert probe.attached_counters["graph_input_bytes"] > 0
    # detached (by _train): the graphs and their input copies are released, the counts stay
    assert probe.counters["graph_input_bytes"] == 0 and len(graphs) == 0
    assert probe.counters["graph_captures"] == counts.captures > 0


def _fn_counting(calls: list):
    def fn(t):
        calls.append(1)
        return {"out": t["x"] * 2}

    return fn


def test_layouts_are_captured_on_second_sight_and_bounded_per_site() -> None:
    graphs = ErrorGraphs(capture=standin_capture, cuda_only=False)
    calls: list = []
    fn = _fn_counting(calls)
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(graphs.run(("a", 0), {"x": x}, fn)["out"], x * 2)
    assert (graphs.counts.eager, graphs.counts.captures) == (1, 0)
    graphs.run(("a", 0), {"x": x + 1}, fn)
    assert graphs.counts.captures == 1 and len(graphs) == 1
    out = graphs.run(("a", 0), {"x": x + 5}, fn)
    assert torch.equal(out["out"], (x + 5) * 2) and graphs.counts.replays == 1
    # the input was copied in: changing the caller's tensor afterwards changes nothing
    y = x + 7
    out = graphs.run(("a", 0), {"x": y}, fn)
    y.zero_()
    assert torch.equal(out["out"], (x + 7) * 2)
    # another shape is another layout: first sight eager, then captured
    wide = torch.ones(2, 4)
    graphs.run(("a", 0), {"x": wide}, fn)
    graphs.run(("a", 0), {"x": wide}, fn)
    assert graphs.counts.captures == 2 and len(graphs) == 2
    # a third layout of the same site replaces the least recently replayed
    tall = torch.ones(3, 3)
    for _ in range(2):
        graphs.run(("a", 0), {"x": tall}, fn)
    assert len(graphs) == MAX_PER_SITE and graphs.counts.evictions == 1
    # other sites keep their own
    graphs.run(("b", 0), {"x": x}, fn)
    graphs.run(("b", 0), {"x": x}, fn)
    assert len(graphs) == MAX_PER_SITE + 1
    # the key's static part separates layouts of equal shapes (a token count, say)
    before = graphs.counts.eager
    graphs.run(("b", 1), {"x": x}, fn)
    assert graphs.counts.eager == before + 1


def test_cpu_tensors_are_not_graphed_by_default() -> None:
    graphs = ErrorGraphs(capture=standin_capture)
    assert not graphs.usable(torch.ones(2))


def test_a_failed_capture_warns_once_and_runs_eagerly_from_then_on() -> None:
    def failing(fn, static):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = ErrorGraphs(capture=failing, cuda_only=False)
    calls: list = []
    fn = _fn_counting(calls)
    x = torch.ones(2, 2)
    graphs.run(("a", 0), {"x": x}, fn)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        out = graphs.run(("a", 0), {"x": x}, fn)
    assert torch.equal(out["out"], x * 2)
    assert not graphs.usable(x) and len(graphs) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        graphs.run(("a", 0), {"x": x}, fn)
    assert graphs.counts.eager == 3 and len(calls) == 3


def test_no_graphs_when_turned_off() -> None:
    setup = zoo.create("dlrm", "tiny")
    probe = Probe(setup.model, replace(QUICK, error_graphs=False))
    assert probe._analyzer.graphs is None
    assert probe.counters["graph_captures"] == 0
    probe.detach()


@pytest.mark.skipif(
    not (torch.cuda.is_available() and has_fp8_gemm(torch.device("cuda"))),
    reason="real CUDA graphs and FP8 GEMMs need a GPU with FP8 tensor cores",
)
def test_real_cuda_graphs_match_the_eager_analysis() -> None:
    def run(error_graphs: bool) -> tuple[dict, dict]:
        setup = zoo.create("dhen", "base", seed=2, device="cuda")
        # every site analysed on the GPU (none small enough for the host)
        config = replace(QUICK, error_graphs=error_graphs, rows=256, host_error_max_size=0)
        probe = Probe(setup.model, config)
        zoo.train(setup, 6, on_step=lambda step, loss: probe.step())
        sums, counters = _sums(probe), probe.counters
        probe.detach()
        return sums, counters

    got, counters = run(True)
    expected, _ = run(False)
    assert counters["graph_replays"] > 0 and counters["graph_captures"] > 0
    assert got.keys() == expected.keys()
    for key in expected:  # the same kernels, replayed: the same sums
        assert _same(got[key], expected[key]), key
