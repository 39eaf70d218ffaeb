"""LoKA in training loops: `Session` (plain loop), the runtime guard, plan broadcast under
torch.distributed; `LokaCallback` (Lightning, in `.lightning`) and `LokaTrainerCallback`
(Hugging Face, in `.hf`) are imported from their modules, so neither library is needed
otherwise."""

from loka.dispatch.integrations.distributed import plan_once
from loka.dispatch.integrations.guard import GuardConfig, GuardEvent, RuntimeGuard
from loka.dispatch.integrations.session import Session, SessionConfig, warmup_probe_config

__all__ = [
    "GuardConfig",
    "GuardEvent",
    "RuntimeGuard",
    "Session",
    "SessionConfig",
    "plan_once",
    "warmup_probe_config",
]
