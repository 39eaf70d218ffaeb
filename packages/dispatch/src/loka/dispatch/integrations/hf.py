"""`LokaTrainerCallback`: a Hugging Face `transformers.Trainer` callback running a `Session`
on the trainer's model.

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[LokaTrainerCallback(SessionConfig(warmup_steps=200))])

`on_step_end` comes after the optimizer step of every (accumulated) training step. Before
it (`on_pre_optimizer_step`, after gradient clipping) the runtime guard checks the gradients:
a non-finite one (an FP8 overflow) drops them all, so that the step changes no weight.
"""

from __future__ import annotations

from typing import Any

from loka.dispatch.extras import explain
from loka.dispatch.integrations.session import Session, SessionConfig

__all__ = [
    "LokaTrainerCallback",
]

try:
    from transformers import TrainerCallback
except ImportError as exc:  # the `hf` extra
    raise explain(exc, "LokaTrainerCallback (the Hugging Face integration)") or exc from None


class LokaTrainerCallback(TrainerCallback):
    def __init__(self, config: SessionConfig | None = None, *, sample: Any = None) -> None:
        self.config = config
        self.sample = sample
        self.session: Session | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        if self.session is None:
            if model is None:
                raise ValueError("LokaTrainerCallback needs the Trainer to pass its model")
            self.session = Session(model, self.config, sample=self.sample)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs) -> None:
        # The Trainer steps regardless: the gradients are dropped instead, and torch's
        # optimizers leave parameters without a gradient (and their state) alone.
        if self.session is not None:
            self.session.before_optimizer_step(optimizer)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.session is not None:
            self.session.step()

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.session is not None:
            self.session.close()
