"""Probe on zoo models and custom sites: attach/detach, tables, bad input, queue, drift."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import loka.zoo as zoo
from loka.probe import Probe, ProbeConfig, register_site
from loka.schema import TableWriteError, read_metadata, read_table

QUICK = ProbeConfig(every=2, warmup_steps=0, rows=64, queue_size=64)


def _hooks(model: nn.Module) -> int:
    count = 0
    for m in model.modules():
        count += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
    return count + sum(len(p._backward_hooks or {}) for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "overrides", "autocast"),
    [("dhen", {}, None), ("sasrec", {"dropout": 0.2}, torch.bfloat16)],
)
def test_training_with_probe_is_bit_identical(name, overrides, autocast) -> None:
    plain = zoo.create(name, "tiny", seed=3, **overrides)
    probed = zoo.create(name, "tiny", seed=3, **overrides)
    torch.manual_seed(0)
    expected = zoo.train(plain, 4, autocast_dtype=autocast)
    torch.manual_seed(0)  # the same dropout stream: Probe draws rows from its own generator
    # DHEN's 26 per-feature projections are left out to keep the test short.
    with Probe(probed.model, replace(QUICK, exclude=("*projections.*",))) as probe:
        got = zoo.train(probed, 4, autocast_dtype=autocast, on_step=lambda step, loss: probe.step())
        assert probe.counters["sampled_steps"] == 2 and probe.errors == []
    assert got == expected
    for (k, a), b in zip(
        plain.model.state_dict().items(), probed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k
    assert _hooks(probed.model) == 0
    plain.model.eval(), probed.model.eval()
    batch = plain.eval_batches(1)[0]
    assert torch.equal(plain.model(batch), probed.model(batch))


def test_tables_save_and_summary(tmp_path) -> None:
    setup = zoo.create("dlrm", "tiny")
    probe = Probe(setup.model, QUICK)
    zoo.train(setup, 4, on_step=lambda step, loss: probe.step())
    tables = probe.tables()
    sites = tables["sites"]
    linears = [n for n, m in setup.model.named_modules() if isinstance(m, nn.Linear)]
    assert sites["site"].to_list() == linears
    first = sites.row(0, named=True)
    assert (first["K"], first["N"], first["M_p50"], first["calls"]) == (13, 32, 256, 2)
    assert first["time_share"] is None and first["fwd_ms"] is None  # no CUDA events on CPU
    stats = tables["tensor_stats"]
    assert set(stats["role"]) == {"input", "weight", "grad_output"}
    assert stats.filter(pl.col("role") == "input")["samples"].min() == 2
    errors = tables["site_errors"]
    delayed = errors["recipe"].str.contains("delayed")
    assert set(errors.filter(~delayed)["n"]) == {2} and set(errors["pass"]) == {
        "fwd",
        "dgrad",
        "wgrad",
    }
    assert set(errors.filter(delayed)["n"]) == {1}  # step 0 has no amax history
    tensorwise = errors.filter(pl.col("recipe") == "e4m3:e4m3/tensor/dynamic")
    assert (tensorwise["bf16_rel_err"] < tensorwise["mean_rel_err"]).all()

    paths = probe.save(tmp_path / "out")
    for name, frame in tables.items():
        assert read_table(paths[name], name).equals(frame)
    assert read_metadata(paths["sites"])["producer"] == "loka-probe"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "site_errors.parquet", "sites.parquet", "tensor_stats.parquet"
    ]  # fmt: skip
    text = probe.summary()
    assert "top.4" in text and "4 step" not in text and "0 dropped" in text
    probe.detach()
    assert probe.tables()["site_errors"].equals(errors)  # still readable after detach
    with pytest.raises(RuntimeError, match="detached"):
        probe.step()


def test_unwritable_destination_fails_cleanly(tmp_path, monkeypatch) -> None:
    setup = zoo.create("dlrm", "tiny")
    with Probe(setup.model, QUICK) as probe:
        zoo.train(setup, 2, on_step=lambda step, loss: probe.step())
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        with pytest.raises(TableWriteError, match="cannot save probe tables"):
            probe.save(blocker / "out")
        good = tmp_path / "good"
        probe.save(good)
        before = {p.name: p.read_bytes() for p in good.iterdir()}
        zoo.train(setup, 2, on_step=lambda step, loss: probe.step())

        import loka.probe.probe as probe_module

        calls = []

        def failing(df, path, name, **kw):
            calls.append(name)
            if len(calls) == 2:
                raise TableWriteError(f"cannot write {path}: disk full")
            return original(df, path, name, **kw)

        original = probe_module.write_table
        monkeypatch.setattr(probe_module, "write_table", failing)
        with pytest.raises(TableWriteError, match="disk full"):
            probe.save(good)
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before  # nothing replaced


def test_nan_and_inf_are_counted_never_fatal(synthetic, every_step) -> None:
    Sites, drive, _ = synthetic
    model = Sites({"lin": (64, 32)})

    def inputs(step, g):
        x = torch.randn(128, 64, generator=g)
        if step == 2:
            x[5, 7] = float("nan")
        if step == 4:
            x[9, 1], x[9, 2] = float("inf"), float("-inf")
        return x

    tables = drive(
        model,
        {"lin": inputs},
        {"lin": lambda s, g: torch.randn(128, 32, generator=g)},
        7,
        every_step,
    )
    stats = tables["tensor_stats"].filter(pl.col("role") == "input")
    assert (stats["nan"].sum(), stats["pos_inf"].sum(), stats["neg_inf"].sum()) == (1, 1, 1)
    assert tables["sites"]["nonfinite_batches"][0] == 2
    errors = tables["site_errors"]
    delayed = errors["recipe"].str.contains("delayed")
    assert set(errors.filter(~delayed)["n"]) == {5}  # steps 2 and 4 are not measured
    assert set(errors.filter(delayed)["n"]) == {4}  # nor step 0 (no amax history yet)
    assert errors["mean_rel_err"].is_finite().all()
    # the NaN in x also reaches dY of nothing here; the gradient sketch stays clean
    assert tables["tensor_stats"].filter(pl.col("role") == "grad_output")["nan"].sum() == 0


def test_model_without_gemm_sites_gets_a_clear_message() -> None:
    with pytest.raises(ValueError, match=r"no GEMM sites.*register_site"):
        Probe(nn.Sequential(nn.ReLU(), nn.LayerNorm(4)))
    with pytest.raises(ValueError, match="excluded"):
        Probe(nn.Sequential(nn.Linear(4, 4)), ProbeConfig(exclude=("*",)))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        Probe("model")  # type: ignore[arg-type]


class FusedNormLinear(nn.Module):
    """A norm+linear whose fused kernel never materializes the normalized input."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(k)
        self.weight = nn.Parameter(torch.randn(n, k) / k**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)

    def loka_gemm_operands(self, args, output):
        return [{"input": self.norm(args[0]), "weight": self.weight, "output": output}]


class Grouped(nn.Module):
    """Several small projections run as one site; their outputs packed in one tensor."""

    loka_gemm_kind = "grouped"

    def __init__(self, k: int, n: int, groups: int) -> None:
        super().__init__()
        self.projections = nn.ModuleList(nn.Linear(k, n) for _ in range(groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, groups, k]
        return torch.stack([p(x[:, i]) for i, p in enumerate(self.projections)], dim=1)

    def loka_gemm_operands(self, args, output):
        return [
            {
                "input": args[0][:, i],
                "weight": p.weight,
                "output": output,
                "grad": lambda g, i=i: g[:, i],
                "bias": True,
            }
            for i, p in enumerate(self.projections)
        ]


class PlainFp8Linear(nn.Module):
    """A linear that is not an nn.Linear subclass and knows nothing about Probe."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, k) / k**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.T


class SubclassLinear(nn.Linear):
    pass


def test_custom_modules_are_gemm_sites() -> None:
    register_site(
        PlainFp8Linear, lambda m, args, out: [{"input": args[0], "weight": m.w, "output": out}]
    )
    model = nn.ModuleDict(
        {
            "fused": FusedNormLinear(32, 48),
            "grouped": Grouped(16, 24, 3),
            "plain": PlainFp8Linear(48, 16),
            "sub": SubclassLinear(16, 8),
        }
    )
    g = torch.Generator().manual_seed(0)
    with Probe(model, ProbeConfig(every=1, warmup_steps=0, queue_size=64)) as probe:
        for _ in range(3):
            x = torch.randn(40, 32, generator=g)
            y = model["plain"](model["fused"](x))
            z = model["grouped"](torch.randn(40, 3, 16, generator=g))
            loss = y.square().sum() + z.square().sum() + model["sub"](y).sum()
            loss.backward()
            probe.step()
        tables = probe.tables()
        assert probe.errors == []
    sites = tables["sites"].select("site", "kind", "K", "N", "groups", "has_bias", "calls")
    assert sites.rows() == [
        ("fused", "linear", 32, 48, 1, False, 3),
        ("grouped", "grouped", 16, 24, 3, True, 3),
        ("plain", "linear", 48, 16, 1, False, 3),
        ("sub", "linear", 16, 8, 1, True, 3),
    ]
    errors = tables["site_errors"]
    assert set(errors["site"]) == {"fused", "grouped", "plain", "sub"}
    assert (
        errors.filter((pl.col("site") == "grouped") & ~pl.col("recipe").str.contains("delayed"))[
            "n"
        ].min()
        == 3
    )
    # the fused site's input statistics are those of the normalized input
    fused = tables["tensor_stats"].filter((pl.col("site") == "fused") & (pl.col("role") == "input"))
    assert fused["rms"][0] == pytest.approx(1.0, rel=0.01)


def test_full_queue_drops_and_counts_sampled_steps() -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    probe = Probe(model, ProbeConfig(every=1, warmup_steps=0, queue_size=1, queue_wait_s=0))
    started, gate = threading.Event(), threading.Event()
    slow = probe._analyzer.process

    def blocked(job):
        started.set()
        gate.wait(timeout=60)
        slow(job)

    probe._worker._process = blocked
    for _ in range(5):
        model(torch.randn(8, 16)).sum().backward()
        probe.step()
        started.wait(timeout=60)
    # one job in the thread, one in the queue, three dropped
    assert probe.counters["dropped_steps"] == 3
    gate.set()
    assert "3 dropped" in probe.summary()
    assert probe.tables()["site_errors"]["n"].max() == 2
    probe.detach()


def test_probe_alone_on_a_dense_schedule_keeps_every_sampled_step() -> None:
    # The default queue holds 2 steps; the training loop waits for a slot (queue_wait_s)
    # rather than drop steps the verdicts need.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    config = ProbeConfig(every=1, warmup_steps=0)
    assert config.queue_size == 2 and config.queue_wait_s is not None
    with Probe(model, config) as probe:
        for _ in range(12):
            model(torch.randn(256, 64)).square().mean().backward()
            probe.step()
        tables = probe.tables()
        assert probe.counters["dropped_steps"] == 0 and probe.counters["sampled_steps"] == 12
    assert tables["site_errors"]["n"].min() >= config.min_batches  # decided sites sample less


def test_a_full_queue_waits_for_a_slot_then_takes_the_job() -> None:
    from loka.probe.worker import Worker

    gate, done = threading.Event(), []
    worker = Worker(lambda job: (gate.wait(timeout=60), done.append(job)), 1, lambda *a: None)
    assert worker.submit(1)  # taken by the thread, which waits on the gate
    while worker._queue.unfinished_tasks and worker._queue.qsize():
        pass
    assert worker.submit(2)  # fills the queue
    assert not worker.submit(3, timeout=0)  # full: refused at once
    threading.Timer(0.1, gate.set).start()
    assert worker.submit(4, timeout=None)  # waits until the thread frees a slot
    worker.close()
    assert done == [1, 2, 4]
    with pytest.raises(ValueError, match="queue_wait_s"):
        ProbeConfig(queue_wait_s=-1)


def test_drift_is_flagged_and_reverified(synthetic, every_step) -> None:
    Sites, drive, _ = synthetic
    model = Sites({"lin": (64, 32)})
    shifted = lambda step, g: torch.randn(96, 64, generator=g) * (1.0 if step < 12 else 64.0)  # noqa: E731
    config = replace(every_step, window_steps=6)
    tables = drive(
        model, {"lin": shifted}, {"lin": lambda s, g: torch.randn(96, 32, generator=g)}, 20, config
    )
    site = tables["sites"].row(0, named=True)
    assert site["drift_step"] == 12 and "input amax" in site["drift_reason"]
    assert site["verify_from"] == 12
    assert set(tables["site_errors"]["first_step"]) == {12}
    assert tables["tensor_stats"]["window"].to_list()[:3] == [0, 0, 0]


def test_decided_sites_are_sampled_less() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    config = ProbeConfig(every=1, warmup_steps=0, rows=64, decided_every=4, min_batches=3, queue_size=64,
                         budgets={"fwd": 0.5, "dgrad": 0.5, "wgrad": 0.5})  # fmt: skip
    with Probe(model, config) as probe:
        for _ in range(16):
            model(torch.randn(64, 32)).square().sum().backward()
            probe.flush()  # let verdicts land before the next plan
            probe.step()
        sites = probe.tables()["sites"]
    assert probe.counters["sampled_steps"] == 16
    # All decided after 5 captures (delayed scaling has no history on step 0, so it needs
    # one more than min_batches), then captured on one sampled step in 4 of the other 11.
    assert set(sites["captured_steps"]) <= {7, 8}


def test_verdicts_do_not_flip_between_seeds() -> None:
    verdicts = []
    for seed in (0, 1):
        setup = zoo.create("dlrm", "tiny", seed=seed)
        config = ProbeConfig(every=1, warmup_steps=0, rows=128, queue_size=64, seed=seed)
        with Probe(setup.model, config) as probe:
            zoo.train(setup, 10, on_step=lambda step, loss: probe.step())
            errors = probe.tables()["site_errors"]
        verdicts.append(
            {
                (r["site"], r["recipe"], r["pass"]): r["verdict"]
                for r in errors.iter_rows(named=True)
            }
        )
    assert verdicts[0].keys() == verdicts[1].keys()
    flips = [k for k, v in verdicts[0].items() if {v, verdicts[1][k]} == {"safe", "unsafe"}]
    assert flips == []
    decided = [k for k, v in verdicts[0].items() if v != "undecided" and v == verdicts[1][k]]
    assert len(decided) > 0.8 * len(verdicts[0])


def test_max_sites_per_step_rotates_through_sites() -> None:
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    config = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=2, queue_size=64)
    with Probe(model, config) as probe:
        for _ in range(6):
            model(torch.randn(32, 16)).sum().backward()
            probe.step()
        sites = probe.tables()["sites"]
    assert sites["captured_steps"].to_list() == [3, 3, 3, 3]


class BrokenSite(nn.Linear):
    def loka_gemm_operands(self, args, output):
        return [{"input": args[0], "weight": self.weight}]  # no "output"


def test_a_failing_site_is_reported_and_training_goes_on() -> None:
    model = nn.Sequential(BrokenSite(8, 8), nn.Linear(8, 4))
    with Probe(model, ProbeConfig(every=1, warmup_steps=0, queue_size=8)) as probe:
        for _ in range(3):
            model(torch.randn(16, 8)).sum().backward()
            probe.step()
        assert len(probe.errors) == 3 and "lacks key 'output'" in probe.errors[0]
        with pytest.warns(RuntimeWarning, match="capture/analysis error"):
            tables = probe.tables()
    assert tables["site_errors"].filter(pl.col("site") == "1")["n"].max() == 3


def test_a_checkpointed_model_is_probed_as_without_checkpointing() -> None:
    """torch.utils.checkpoint reruns each region's forward inside the backward: Probe's
    forward hooks skip the rerun, so the tables are those of the same run without it."""
    from torch.utils.checkpoint import checkpoint

    tables = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
        g = torch.Generator().manual_seed(1)
        config = ProbeConfig(every=1, warmup_steps=0, rows=16, queue_size=16)
        with Probe(model, config) as probe:
            for _ in range(3):
                x = torch.randn(24, 32, generator=g, requires_grad=True)
                y = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
                y.square().mean().backward()
                probe.step()
            assert probe.errors == []
            tables[checkpointed] = probe.tables()
    sites = tables[True]["sites"]
    assert sites["calls"].to_list() == [3, 3]  # once a step, not twice
    assert sites["norm"].to_list() == ["0", None]
    for name in ("sites", "site_errors"):
        assert tables[True][name].equals(tables[False][name]), name


def _rowwise_only(pass_: str) -> ProbeConfig:
    """Every step sampled (256 rows), and only rowwise e4m3 measured, in `pass_`."""
    return ProbeConfig(every=1, warmup_steps=0, rows=256, queue_size=64,
                       recipes={pass_: ["e4m3:e4m3/row/dynamic"]})  # fmt: skip


def test_a_site_whose_inputs_barely_vary_is_unsafe_in_fwd() -> None:
    # Hidden states that are one shared vector plus 1% per token (a model on a loss plateau):
    # rowwise e4m3 errs ~4% overall, inside the fwd budget, and more than the whole
    # token-to-token part of the output, which is what the model learns from.
    torch.manual_seed(0)
    layer = nn.Linear(256, 128, bias=False)
    shared = torch.randn(1, 256)
    config = _rowwise_only("fwd")
    with Probe(layer, config) as probe:
        for _ in range(8):
            x = shared + 0.01 * torch.randn(512, 256)
            layer(x).square().mean().backward()
            probe.step()
        errors = probe.tables()["site_errors"]
    fwd = errors.filter(pl.col("pass") == "fwd").row(0, named=True)
    allowance = config.varying_allowance
    assert fwd["balanced_rel_err"] < fwd["budget"] < fwd["varying_rel_err"] / allowance
    assert fwd["mean_rel_err"] == pytest.approx(fwd["varying_rel_err"] / allowance)
    assert fwd["verdict"] == "unsafe"
    assert fwd["bf16_varying_rel_err"] < fwd["varying_rel_err"] / 5


def test_a_site_whose_gradients_cancel_over_the_batch_is_unsafe_in_dgrad(
    plateau_gradients,
) -> None:
    # Output gradients that cancel over the batch (a model on a loss plateau): rowwise e4m3
    # errs a few percent per token, within the dgrad budget, and drowns the gradient's sum
    # over the batch, which every gradient upstream is made of. Probe samples 256 of the
    # 2048 tokens and estimates the whole batch's sum.
    layer = nn.Linear(512, 256, bias=False)
    config = _rowwise_only("dgrad")
    with Probe(layer, config) as probe:
        for step in range(8):
            dy, weight = plateau_gradients(2048, seed=step)
            layer.weight.data.copy_(weight.float())
            (layer(torch.randn(2048, 512)) * dy.float()).sum().backward()
            probe.step()
        errors = probe.tables()["site_errors"]
    dgrad = errors.filter(pl.col("pass") == "dgrad").row(0, named=True)
    assert dgrad["balanced_rel_err"] < dgrad["budget"] < dgrad["summed_rel_err"]
    assert dgrad["varying_rel_err"] < dgrad["budget"]
    assert dgrad["mean_rel_err"] == pytest.approx(dgrad["summed_rel_err"], rel=0.2)
    assert dgrad["verdict"] == "unsafe"
    assert dgrad["bf16_summed_rel_err"] < dgrad["summed_rel_err"] / 5


@pytest.mark.parametrize("name", ["varying_allowance", "summed_allowance"])
def test_the_allowances_are_checked(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} is a factor >= 1"):
        ProbeConfig(**{name: 0.5})


def test_center_is_refused_for_wgrad() -> None:
    with pytest.raises(ValueError, match="center is for fwd and dgrad"):
        ProbeConfig(recipes={"wgrad": ["e4m3:e4m3/row/dynamic/center"]})


def test_a_series_saved_before_the_varying_and_summed_errors_reads_its_balanced_ones() -> None:
    from loka.probe.state import ErrorSeries

    old = {"steps": [3, 1], "balanced": [0.02, 0.01], "frobenius": [0.02, 0.01],
           "ref_sq": [1.0, 1.0], "err_sq": [4e-4, 1e-4], "max_abs": [0.1, 0.1],
           "emulated": True}  # fmt: skip
    new = ErrorSeries()
    new.add(2, np.array([1e-4, 1.0, 1e-4, 1.0, 0.1, 0.04, 1.0, 0.09, 1.0]), emulated=False)
    merged = ErrorSeries.merged([old, new.to_dict()])
    assert merged.steps == [1, 2, 3]
    assert merged.varying == pytest.approx([0.01, 0.2, 0.02])
    assert merged.summed == pytest.approx([0.01, 0.3, 0.02])
    config = ProbeConfig()
    assert merged.largest_part(np.ones(3, bool), None, config) == "summed"
    assert merged.errors(None, config) == pytest.approx([0.01, 0.3, 0.02])


def test_probing_a_compiled_model_warns_that_its_graph_would_keep_the_hooks() -> None:
    from loka.probe.probe import CompiledModelWarning

    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.warns(CompiledModelWarning, match="probe the uncompiled module"):
        probe = Probe(torch.compile(model, backend="eager"), QUICK)
    assert probe.model is model  # its sites are the wrapped module's
    probe.detach()
    model.compile(backend="eager")  # compiled in place
    with pytest.warns(CompiledModelWarning):
        Probe(model, QUICK).detach()
