"""Session in a plain loop (warm-up, plan, apply, guard, re-probe), under DDP with gloo (two
processes: the plan is made once and broadcast), and in Lightning and HF Trainer."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # FP8 passes run in Triton's interpreter

import json
import textwrap

import polars as pl
import pytest
import torch
from torch import nn

import loka.zoo as zoo
from loka.dispatch import PlanConfig, Session, SessionConfig
from loka.dispatch.integrations import GuardConfig
from loka.dispatch.integrations.guard import GuardEvent
from loka.dispatch.tables import read_plan
from loka.dispatch.testing import synthetic_kernel_bench
from loka.dispatch.verify import VerifyConfig
from loka.mods.fp8_linear import Fp8Linear
from loka.probe import ProbeConfig

# blocks.i.fc1 of dhen tiny at batch 32: FP8 wins there in the synthetic table.
BENCH = synthetic_kernel_bench([(32, 32, 64)])
PROBE = ProbeConfig(
    every=1, warmup_steps=0, max_sites_per_step=None, min_batches=2, rows=32, queue_size=16
)


def _config(**kw) -> SessionConfig:
    # One FP8 site keeps the interpreted FP8 steps affordable.
    plan = PlanConfig(exclude=("*blocks.1.*",))
    return SessionConfig(warmup_steps=2, probe=PROBE, kernel_bench=BENCH, plan=plan, **kw)


def test_plain_loop_session_plans_applies_guards_and_reprobes(tmp_path) -> None:
    setup = zoo.create("dhen", "tiny", seed=2, batch_size=32)
    events = []
    config = _config(guard=GuardConfig(check_every=2), reprobe_every=2, reprobe_steps=1,
                     out_dir=tmp_path)  # fmt: skip
    session = Session(setup.model, config, on_event=events.append)
    losses = zoo.train(setup, 6, on_step=lambda step, loss: session.step(loss))
    assert session.phase == "applied" and session.applied.sites == ["blocks.0.fc1"]
    assert all(type(setup.model.get_submodule(s)) is Fp8Linear for s in session.applied.sites)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any("plan applied after 2 step(s)" in e for e in events)
    assert any("re-probing for 1 step(s)" in e for e in events)
    assert session.guard.events == []  # nothing went wrong, nothing demoted
    for name in ("sites", "site_errors", "kernel_bench", "plan", "report"):
        assert (tmp_path / (f"{name}.html" if name == "report" else f"{name}.parquet")).exists()
    session.undo()
    assert not any(isinstance(m, Fp8Linear) for m in setup.model.modules())
    with pytest.raises(ValueError, match="reprobe_every"):
        SessionConfig(reprobe_every=5, reprobe_steps=5)


def test_a_resumed_session_applies_the_saved_plan_as_it_ran(tmp_path) -> None:
    from loka.dispatch.apply_plan import PlanMismatchError

    setup = zoo.create("dhen", "tiny", seed=2, batch_size=32)
    config = SessionConfig(warmup_steps=2, probe=PROBE, kernel_bench=BENCH, out_dir=tmp_path)
    session = Session(setup.model, config)
    zoo.train(setup, 2, on_step=lambda step, loss: session.step(loss))
    assert session.applied.sites == ["blocks.0.fc1", "blocks.1.fc1"]
    guard_step = session.guard.step

    def overflowing(step: int) -> list[GuardEvent]:  # the guard finds an FP8 overflow
        guard_step(step)
        session.applied.demote("blocks.1.fc1", "step 2: a test demotion")
        return [GuardEvent(step, "blocks.1.fc1", "demoted", "step 2: a test demotion")]

    session.guard.step = overflowing
    zoo.train(setup, 1, on_step=lambda step, loss: session.step(loss))
    session.close()
    saved = json.loads(read_plan(tmp_path / "plan.parquet").metadata["demoted"])
    assert saved["sites"] == {"blocks.1.fc1": "step 2: a test demotion"}  # saved at once

    again = zoo.create("dhen", "tiny", seed=2, batch_size=32)  # a restarted job
    events = []
    resumed = Session(again.model, SessionConfig(resume=tmp_path), on_event=events.append)
    assert resumed.phase == "applied" and resumed.probe is None
    assert resumed.applied.sites == ["blocks.0.fc1", "blocks.1.fc1"]
    assert resumed.applied.demoted == {"blocks.1.fc1": "step 2: a test demotion"}
    assert type(again.model.blocks[0].fc1) is Fp8Linear
    assert type(again.model.blocks[1].fc1) is nn.Linear
    assert events[0].startswith(f"resumed from {tmp_path / 'plan.parquet'}: 2 site(s) in FP8")
    losses = zoo.train(again, 2, on_step=lambda step, loss: resumed.step(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    with pytest.raises(RuntimeError, match="already applied"):
        resumed.plan_and_apply()

    other = zoo.create("wukong", "tiny", seed=2)
    with pytest.raises(PlanMismatchError, match="made for another model"):
        Session(other.model, SessionConfig(resume=tmp_path))
    assert not any(isinstance(m, Fp8Linear) for m in other.model.modules())
    with pytest.raises(FileNotFoundError, match=r"SessionConfig\.resume: no plan at"):
        Session(other.model, SessionConfig(resume=tmp_path / "missing"))


WORKER = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import loka.zoo as zoo
    import loka.dispatch.integrations.session as session_module
    from loka.dispatch import PlanConfig, Session, SessionConfig
    from loka.dispatch.testing import synthetic_kernel_bench
    from loka.probe import ProbeConfig

    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    planned = []
    real = session_module.make_plan
    session_module.make_plan = lambda *a, **k: planned.append(rank) or real(*a, **k)
    setup = zoo.create("dhen", "tiny", seed=5, batch_size=32)
    model = DDP(setup.model)
    probe = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, min_batches=2, rows=32, queue_size=16)
    config = SessionConfig(warmup_steps=2, probe=probe,
                           kernel_bench=synthetic_kernel_bench([(16, 32, 64)]),
                           plan=PlanConfig(exclude=("*blocks.1.*",)))
    session = Session(model, config)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = setup.train_batches()
    for step in range(3):
        batch = next(batches)
        batch = {k: v.chunk(2)[rank] for k, v in batch.items()}  # each rank its half
        loss = setup.loss(model, batch)
        opt.zero_grad(); loss.backward(); opt.step()
        session.step(loss)
    weight = model.module.blocks[0].fc1.weight.detach().clone()
    dist.all_reduce(weight)
    same = torch.allclose(weight / 2, model.module.blocks[0].fc1.weight)
    print(json.dumps({"rank": rank, "planned": planned, "sites": session.applied.sites,
                      "plan": session.plan.table.to_dicts(), "same_weights": bool(same),
                      "types": [type(m).__name__ for m in model.modules()]}), flush=True)
    session.close()
    dist.destroy_process_group()
    # Past this point only interpreter finalization is left, where a native thread (gloo's,
    # by every sign) now and then meets std::terminate ("terminate called without an active
    # exception", 1 run in ~60 under load): not what this test is about, so skip it.
    sys.stderr.flush()
    os._exit(0)
    """
)


def test_ddp_with_gloo_plans_once_and_every_rank_applies_the_same_plan(two_gloo_ranks) -> None:
    results = two_gloo_ranks(WORKER, timeout=240)
    r0, r1 = sorted(results, key=lambda r: r["rank"])
    assert r0["planned"] == [0] and r1["planned"] == []  # made once, on rank 0
    assert r0["plan"] == r1["plan"] and r0["types"] == r1["types"]
    assert r0["sites"] == r1["sites"] == ["module.blocks.0.fc1"]
    assert r0["same_weights"] and r1["same_weights"]  # DDP kept the replicas in sync


class _ClickModule(nn.Module):
    """A zoo model behind the interface HF's Trainer and Lightning expect."""

    def __init__(self, setup) -> None:
        super().__init__()
        self.setup, self.model = setup, setup.model

    def forward(self, dense, sparse, labels):
        batch = {"dense": dense, "sparse": sparse, "label": labels}
        return {"loss": self.setup.loss(self.model, batch)}


def _samples(setup, n_batches: int) -> list[dict]:
    batches = setup.train_batches()
    out = []
    for _ in range(n_batches):
        batch = next(batches)
        batch["labels"] = batch.pop("label")  # the name HF's collator passes on
        out += [{k: v[i] for k, v in batch.items()} for i in range(len(batch["labels"]))]
    return out


def test_lightning_callback_runs_the_session(tmp_path) -> None:
    import lightning.pytorch as lp

    from loka.dispatch.integrations.lightning import LokaCallback

    setup = zoo.create("dhen", "tiny", seed=3, batch_size=32)

    class Module(lp.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _ClickModule(setup)

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    loader = torch.utils.data.DataLoader(_samples(setup, 6), batch_size=32)
    callback = LokaCallback(_config())
    trainer = lp.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback], default_root_dir=tmp_path)  # fmt: skip
    module = Module()
    trainer.fit(module, loader)
    assert callback.session.phase == "applied"
    assert callback.session.applied.sites == ["net.model.blocks.0.fc1"]
    assert type(module.net.model.blocks[0].fc1) is Fp8Linear


def test_hf_trainer_callback_runs_the_session(tmp_path) -> None:
    from transformers import Trainer, TrainingArguments

    from loka.dispatch.integrations.hf import LokaTrainerCallback

    setup = zoo.create("dhen", "tiny", seed=4, batch_size=32)
    model = _ClickModule(setup)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=32,
                             report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip
    callback = LokaTrainerCallback(_config())
    Trainer(model=model, args=args, train_dataset=_samples(setup, 6), callbacks=[callback]).train()
    assert callback.session.phase == "applied"
    assert callback.session.applied.sites == ["model.blocks.0.fc1"]
    assert type(setup.model.blocks[0].fc1) is Fp8Linear


def test_lightning_callback_steps_per_optimizer_step_under_gradient_accumulation(
    tmp_path,
) -> None:
    import lightning.pytorch as lp

    from loka.dispatch.integrations.lightning import LokaCallback

    setup = zoo.create("dhen", "tiny", seed=5, batch_size=16)

    class Module(lp.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _ClickModule(setup)

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    loader = torch.utils.data.DataLoader(_samples(setup, 8), batch_size=16)
    # A warm-up longer than the run: only the step count is under test.
    callback = LokaCallback(SessionConfig(warmup_steps=50, probe=PROBE, kernel_bench=BENCH))
    trainer = lp.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback],
                         default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Module(), loader)
    assert trainer.global_step == 3
    assert callback.session.steps == 3  # six micro-batches, three optimizer steps


def test_a_compiled_model_is_probed_planned_and_applied_through_the_module_it_compiles() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    compiled = torch.compile(model, backend="eager")
    bench = synthetic_kernel_bench([(32, 32, 64), (32, 64, 32)], backend="torch.native")
    events: list[str] = []
    config = SessionConfig(warmup_steps=3, probe=PROBE, kernel_bench=bench)
    session = Session(compiled, config, on_event=events.append)
    assert session.compiled and session.model is model
    assert session.config.plan.mode == "compiled"
    assert "torch.compile'd" in events[0]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    from torch._dynamo.utils import counters

    counters.clear()
    for _ in range(5):
        loss = compiled(torch.randn(32, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        session.step(loss)
    assert session.phase == "applied"
    # Site names are the model's own, and the plan's FP8 sites run the traceable backend.
    assert set(session.tables["sites"]["site"]) == {"0", "2"}
    assert session.applied.sites and all(isinstance(model.get_submodule(s), Fp8Linear)
                                         for s in session.applied.sites)  # fmt: skip
    backends = set(session.plan.table.filter(pl.col("recipe") != "bf16")["backend"])
    assert backends == {"torch.native"}
    # Probe's hooks run outside the graph: no recompile storm while probing.
    assert counters["stats"]["unique_graphs"] <= 8
    # The README's next step: which compile options the planned model wants, on its step
    # (Dynamo's eager backend stands in for inductor, whose settings are what differ).
    from loka.dispatch.compile_options import choose_compile_options

    compiled_with: list[dict] = []

    def eager_compile(module, options):
        compiled_with.append(options)
        return torch.compile(module, backend="eager")

    def train_step(run):
        run(torch.randn(32, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    before = model[0].weight.detach().clone()
    choice = choose_compile_options(model, train_step, blocks=2, steps_per_block=1,
                                    warmup_steps=1, compile=eager_compile)  # fmt: skip
    assert compiled_with == [{"triton.multi_kernel": 1, "fx_graph_cache": False}, {}]
    assert set(choice.step_ms) == {"multi-kernel", "mode"}
    assert not torch.equal(model[0].weight, before)  # real training steps, plan in place
    assert all(isinstance(model.get_submodule(s), Fp8Linear) for s in session.applied.sites)


def test_verifying_a_compiled_model_raises_dynamos_recompile_limit() -> None:
    import torch._dynamo

    model = nn.Sequential(nn.Linear(32, 32))
    session = Session(torch.compile(model, backend="eager"), SessionConfig(warmup_steps=1))
    before = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8
        session._allow_recompiles(VerifyConfig(max_rounds=6))
        assert torch._dynamo.config.recompile_limit == 16
        assert any("recompile_limit raised to 16" in e for e in session.events)
    finally:
        torch._dynamo.config.recompile_limit = before
        session.close()


FSDP_WORKER = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    import loka.zoo as zoo
    from loka.dispatch import PlanConfig, Session, SessionConfig
    from loka.dispatch.integrations import GuardConfig
    from loka.dispatch.testing import synthetic_kernel_bench
    from loka.probe import ProbeConfig

    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {"rank": rank}
    for layout in ("root", "per-linear"):
        setup = zoo.create("dhen", "tiny", seed=5, batch_size=32)
        model = setup.model
        if layout == "per-linear":  # fully_shard on the linears themselves, then the root
            for module in list(model.modules()):
                if type(module) is nn.Linear:
                    fully_shard(module)
        fully_shard(model)
        probe = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, min_batches=2,
                            rows=32, queue_size=16)
        config = SessionConfig(warmup_steps=2, probe=probe,
                               kernel_bench=synthetic_kernel_bench([(16, 32, 64)]),
                               plan=PlanConfig(exclude=("*blocks.1.*",)),
                               guard=GuardConfig(check_every=1))
        session = Session(model, config)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = setup.train_batches()
        losses = []

        def step():
            batch = {k: v.chunk(2)[rank] for k, v in next(batches).items()}
            loss = setup.loss(model, batch)
            opt.zero_grad(); loss.backward()
            if session.before_optimizer_step(opt):
                opt.step()
            session.step(loss)
            losses.append(loss.item())

        for _ in range(4):
            step()
        applied = session.applied
        site = applied.sites[0]
        module = model.get_submodule(site)
        row = {"sites": applied.sites, "type": type(module).__name__, "active": applied.active,
               "norm": session.tables["sites"].filter(
                   session.tables["sites"]["site"] == site)["norm"].to_list()}
        applied.use([])  # the bf16 variant: the same object, switched by its config
        row["off"] = [applied.active, model.get_submodule(site) is module,
                      module.plan.all_high_precision]
        step()
        applied.use(applied.sites)
        row["on"] = [applied.active, module.plan.all_high_precision]
        step()
        applied.demote(site, "test")
        row["demoted"] = [applied.active, module.plan.all_high_precision]
        step()
        session.undo()
        row["undone"] = type(model.get_submodule(site)).__name__
        step()
        row["finite"] = all(map(lambda v: v == v and abs(v) < 1e9, losses))
        row["guard_events"] = len(session.guard.events)
        out[layout] = row
        session.close()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # as the DDP worker: gloo's threads and interpreter finalization
    """
)


def test_fsdp2_sharded_models_are_probed_planned_and_applied_in_place(two_gloo_ranks) -> None:
    results = two_gloo_ranks(FSDP_WORKER)
    for result in results:
        for layout, fp8_type, plain_type in (("root", "Fp8Linear", "Linear"),
                                             ("per-linear", "FSDPFp8Linear", "FSDPLinear")):  # fmt: skip
            row = result[layout]
            site = "blocks.0.fc1"
            assert row["sites"] == [site] and row["type"] == fp8_type, (layout, row)
            assert row["norm"] == ["blocks.0.norm"]  # Probe's norm trace sees through FSDP
            assert row["active"] == [site]
            assert row["off"] == [[], True, True]  # switched off in place, bf16 config
            assert row["on"] == [[site], False]
            assert row["demoted"] == [[], True]
            assert row["undone"] == plain_type
            assert row["finite"] and row["guard_events"] == 0, (layout, row)


def test_the_warmup_probes_every_site_densely_and_on_the_gpu() -> None:
    """A dense phase samples every site on every sampled step, so the small sites' error
    analysis goes to the GPU with the rest (CUDA graphs replay it there)."""
    from loka.dispatch.integrations.session import warmup_probe_config

    config = warmup_probe_config(50)
    assert (config.every, config.max_sites_per_step, config.host_error_max_size) == (1, None, 0)
    assert config.error_graphs and ProbeConfig().host_error_max_size > 0
    assert warmup_probe_config(200).every == 20


class _ThreeLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 32)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return x


@pytest.mark.parametrize("how", ["wrapper", "in place"])
def test_a_compiled_model_runs_eagerly_while_watched_and_as_one_graph_once_planned(how) -> None:
    """Dynamo keeps a module's hooks as they were at its first compiled call: compiled
    while Probe watched it, the planned model's forward ran as one graph per linear. So the
    compiled wrapper runs eagerly during the warm-up and on the guard's check steps, and its
    first compiled call traces the planned model whole."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    graphs_run: list[int] = []

    def counting_backend(gm, example_inputs):
        def run(*args):
            graphs_run[-1] += 1
            return gm.forward(*args)

        return run

    # A model class of its own, as users' are: Dynamo does not start a frame in torch.nn's
    # code (nn.Sequential's forward), so `model.compile()` of one would compile the FP8
    # linears' forwards one by one.
    model = _ThreeLinears()
    if how == "wrapper":
        compiled = torch.compile(model, backend=counting_backend)
    else:  # model.compile(): no wrapper, the module's own call is compiled
        model.compile(backend=counting_backend)
        compiled = model
    bench = synthetic_kernel_bench([(32, 32, 64), (32, 64, 64), (32, 64, 32)],
                                   backend="torch.native")  # fmt: skip
    config = SessionConfig(warmup_steps=4, decide_steps=0, probe=PROBE, kernel_bench=bench,
                           guard=GuardConfig(check_every=3))  # fmt: skip
    session = Session(compiled, config)
    assert session.compiled and session.config.plan.mode == "compiled"
    assert any("runs eagerly while Probe" in e for e in session.events)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    phases, armed = [], []
    for _ in range(12):
        graphs_run.append(0)
        phases.append(session.phase)
        armed.append(session.guard is not None and session.guard.armed)
        loss = compiled(torch.randn(32, 32)).pow(2).mean()
        loss.backward()
        assert session.before_optimizer_step(opt)
        opt.step()
        opt.zero_grad()
        session.step(loss)
    assert session.applied.sites  # FP8 sites in the graph
    for phase, was_armed, n in zip(phases, armed, graphs_run, strict=True):
        watched = phase == "warmup" or was_armed
        assert n == (0 if watched else 1), (phase, was_armed, n)
    assert any(armed) and phases.count("applied") > sum(armed)
    session.close()
    assert not session._switch.eager
    graphs_run.append(0)
    compiled(torch.randn(32, 32))
    assert graphs_run[-1] == 1


def test_the_eager_switch_takes_compiled_modules_only_and_restores_the_compiled_call() -> None:
    from loka.dispatch.integrations.eager_switch import EagerSwitch

    with pytest.raises(TypeError, match=r"not a torch\.compile'd module: Linear"):
        EagerSwitch(nn.Linear(2, 2))
    wrapper = torch.compile(nn.Linear(2, 2), backend="eager")
    compiled_forward = wrapper.forward
    switch = EagerSwitch(wrapper)
    switch.set(True)
    switch.set(True)  # idempotent
    assert wrapper.forward == wrapper._orig_mod.__call__
    switch.set(False)
    assert wrapper.forward is compiled_forward
