"""An FP8 overflow loses no weights (issue 16 item 1): the guard checks the gradients before
the optimizer step, drops them when one is non-finite (the step changes nothing) and demotes
the site at fault; in a plain loop (return value, optimizer hook), Lightning and HF."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # FP8 passes run in Triton's interpreter

import math
import warnings

import pytest
import torch

import loka.zoo as zoo
from loka.dispatch import Session
from loka.dispatch.integrations import GuardConfig
from loka.mods.fp8_linear import Fp8Linear

sys.path.insert(0, os.path.dirname(__file__))
from test_dispatch_session import _ClickModule, _config, _samples

SITE = "blocks.0.fc1"  # the one FP8 site of `_config`'s plan
INJECT = 3  # warm-up is steps 0-1; the plan runs from step 2


def _scale_input(module: torch.nn.Module, factor: float = 1e36):
    return module.register_forward_pre_hook(lambda m, args: (args[0] * factor, *args[1:]))


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _all_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("how", ["return-value", "optimizer-hook"])
def test_an_fp8_overflow_skips_the_step_and_training_goes_on(how) -> None:
    setup = zoo.create("dhen", "tiny", seed=2, batch_size=32)
    model = setup.model
    # The optimizer hook path with a sparse guard: the overflow falls on an unarmed step.
    check_every = 1 if how == "return-value" else 50
    session = Session(model, _config(guard=GuardConfig(check_every=check_every)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if how == "optimizer-hook":
        session.guard_optimizer(optimizer)
    batches = setup.train_batches()
    losses, stepped = [], []
    for step in range(8):
        handle = None
        if step == INJECT:
            assert type(model.get_submodule(SITE)) is Fp8Linear
            handle = _scale_input(model.get_submodule(SITE))
            before = _params(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # overflow warnings of the interpreter
            loss = setup.loss(model, next(batches))
            loss.backward()
        if how == "optimizer-hook":
            optimizer.step()  # unconditionally: the hook leaves it nothing to apply
            stepped.append(True)
        elif ok := session.before_optimizer_step(optimizer):
            optimizer.step()
            stepped.append(ok)
        else:
            stepped.append(ok)
        optimizer.zero_grad()
        session.step(loss)
        if handle is not None:
            handle.remove()
            after = _params(model)
            assert all(torch.equal(before[n], after[n]) for n in before)  # weights unchanged
        losses.append(float(loss))
        assert _all_finite(model), f"step {step}: a parameter is non-finite"
    assert not math.isfinite(losses[INJECT])  # the overflow happened
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i != INJECT)
    assert session.skipped_steps == 1 and session.guard.skipped_steps == 1
    skipped = [e for e in session.guard.events if e.action == "skipped"]
    assert [e.step for e in skipped] == [INJECT] and "weights unchanged" in skipped[0].reason
    assert any(f"step {INJECT}: optimizer step skipped" in e for e in session.events)
    if how == "return-value":
        assert stepped[INJECT] is False and stepped.count(False) == 1


def test_a_site_that_overflows_is_demoted_before_its_update() -> None:
    setup = zoo.create("dhen", "tiny", seed=2, batch_size=32)
    model = setup.model
    session = Session(model, _config(guard=GuardConfig(check_every=50)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    batches = setup.train_batches()
    losses = []
    for step in range(7):
        if step == INJECT:  # from now on the FP8 module overflows by itself, until demoted
            site = model.get_submodule(SITE)
            forward = site.forward
            site.forward = lambda x, forward=forward: forward(x) * float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = setup.loss(model, next(batches))
            loss.backward()
        if session.before_optimizer_step(optimizer):
            optimizer.step()
        optimizer.zero_grad()
        session.step(loss)
        losses.append(float(loss))
        assert _all_finite(model), f"step {step}: a parameter is non-finite"
    # Unarmed when it first overflowed: skipped, the next step watched, the site found there.
    events = [(e.step, e.site, e.action) for e in session.guard.events if e.site in ("", SITE)]
    assert events == [(INJECT, "", "skipped"), (INJECT + 1, SITE, "demoted"),
                      (INJECT + 1, "", "skipped")]  # fmt: skip
    assert SITE in session.applied.demoted and type(model.get_submodule(SITE)) is not Fp8Linear
    assert all(math.isfinite(v) for v in losses[INJECT + 2 :])


def _overflow_once(setup, on_call: int):
    """A forward that scales the FP8 site's input by 1e36 on its `on_call`-th call."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] == on_call + 1:

            def once(site, site_args):
                handle.remove()
                return (site_args[0] * 1e36, *site_args[1:])

            handle = module.model.get_submodule(SITE).register_forward_pre_hook(once)
        return None

    return hook


def test_lightning_callback_skips_an_overflowing_step(tmp_path) -> None:
    import lightning.pytorch as lp

    from loka.dispatch.integrations.lightning import LokaCallback

    setup = zoo.create("dhen", "tiny", seed=3, batch_size=32)
    losses = []

    class Module(lp.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _ClickModule(setup)
            self.net.register_forward_pre_hook(_overflow_once(setup, INJECT), with_kwargs=True)

        def training_step(self, batch, batch_idx):
            loss = self.net(**batch)["loss"]
            losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    loader = torch.utils.data.DataLoader(_samples(setup, 7), batch_size=32)
    callback = LokaCallback(_config())
    trainer = lp.Trainer(max_steps=7, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback], default_root_dir=tmp_path)  # fmt: skip
    module = Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    assert not math.isfinite(losses[INJECT]) and len(losses) == 7
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i != INJECT)
    assert _all_finite(module) and callback.session.skipped_steps == 1


def test_hf_trainer_callback_skips_an_overflowing_step(tmp_path) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from loka.dispatch.integrations.hf import LokaTrainerCallback

    setup = zoo.create("dhen", "tiny", seed=4, batch_size=32)
    model = _ClickModule(setup)
    model.register_forward_pre_hook(_overflow_once(setup, INJECT), with_kwargs=True)
    finite = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
            finite.append(_all_finite(model))

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=7, per_device_train_batch_size=32,
                             report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip
    callback = LokaTrainerCallback(_config())
    trainer = Trainer(model=model, args=args, train_dataset=_samples(setup, 7),
                      callbacks=[callback, Watch()])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert finite == [True] * 7 and callback.session.skipped_steps == 1
    batch = next(setup.train_batches())
    assert math.isfinite(float(setup.loss(setup.model, batch)))
