"""`LokaTrainerCallback`: a Hugging Face `transformers.Trainer` callback running a `Session`
on the trainer's model.

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[LokaTrainerCallback(SessionConfig(warmup_steps=200))])

`on_step_end` comes after the optimizer step of every (accumulated) training step.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from loka.dispatch.integrations.session import Session, SessionConfig


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

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.session is not None:
            self.session.step()

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.session is not None:
            self.session.close()
