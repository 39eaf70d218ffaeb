"""`LokaCallback`: a PyTorch Lightning callback running a `Session` on the LightningModule.

    trainer = lightning.Trainer(callbacks=[LokaCallback(SessionConfig(warmup_steps=200))])

The session starts with training (bf16 warm-up with Probe), plans and applies after the
warm-up, and steps after every optimizer step (Lightning's `on_train_batch_end` once
`global_step` moved: micro-batches of gradient accumulation are not steps). Before
each optimizer step (`on_before_optimizer_step`) the runtime guard checks the gradients: a
non-finite one (an FP8 overflow) drops them all, so that the step changes no weight.
"""

from __future__ import annotations

from typing import Any

from loka.dispatch.extras import explain
from loka.dispatch.integrations.session import Session, SessionConfig

__all__ = [
    "LokaCallback",
]

try:
    import lightning.pytorch as lp
except ImportError as exc:  # the `lightning` extra
    raise explain(exc, "LokaCallback (the Lightning integration)") or exc from None


class LokaCallback(lp.Callback):
    def __init__(self, config: SessionConfig | None = None, *, sample: Any = None) -> None:
        super().__init__()
        self.config = config
        self.sample = sample
        self.session: Session | None = None
        self._global_step = 0  # trainer.global_step at the last session step

    def on_train_start(self, trainer: lp.Trainer, pl_module: lp.LightningModule) -> None:
        self._global_step = trainer.global_step
        if self.session is None:
            self.session = Session(pl_module, self.config, sample=self.sample)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Lightning cannot skip the step from here: the gradients are dropped instead, and
        # torch's optimizers leave parameters without a gradient (and their state) alone.
        if self.session is not None:
            self.session.before_optimizer_step(optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning calls this after every micro-batch, and after the optimizer step on the
        # batch that stepped: with accumulate_grad_batches > 1 only those are session steps
        # (global_step counts optimizer steps, as the HF Trainer's on_step_end does).
        if self.session is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if trainer.global_step == self._global_step:
            return
        self._global_step = trainer.global_step
        self.session.step(loss.detach() if hasattr(loss, "detach") else loss)

    def on_train_end(self, trainer: lp.Trainer, pl_module: lp.LightningModule) -> None:
        if self.session is not None:
            self.session.close()
