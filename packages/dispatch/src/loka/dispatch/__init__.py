"""loka.dispatch: benchmark kernels, plan each GEMM site, apply the plan, keep it honest.

    tables = probe.tables()                                # loka.probe, or load_probe_tables
    bench = benchmark(site_shapes(tables["sites"]), cost_model=CostModel.shipped()).table
    plan = make_plan(tables["sites"], tables["site_errors"], bench)
    applied = apply(model, plan)                           # applied.undo() reverses it

After `apply`, `loka.dispatch.verify.verify(step_fn, applied)` times the real step against
bf16 and demotes sites until the plan is not slower. In a training loop: `Session(model, SessionConfig(...))`
and `session.step()` after each optimizer step (it verifies too); `LokaCallback` (Lightning) and `LokaTrainerCallback` (Hugging Face) live in
`loka.dispatch.integrations.lightning` / `.hf`.

Names are imported on first use, so that `loka --help` and the CLI's light commands do not
load torch, Triton and matplotlib.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "loka.dispatch.apply_plan": ("Applied", "ApplyConfig", "PlanFallbackWarning",
                                 "PlanMismatchError", "apply"),
    "loka.dispatch.bench": ("BenchCache", "BenchResult", "CacheMismatchError", "CostModel",
                            "Shape", "benchmark", "site_shapes"),
    "loka.dispatch.device": ("DeviceInfo",),
    "loka.dispatch.integrations": ("GuardConfig", "RuntimeGuard", "Session", "SessionConfig"),
    "loka.dispatch.planner": ("Plan", "PlanConfig", "PlanSummary", "make_plan"),
    "loka.dispatch.report": ("write_report",),
    "loka.dispatch.tables": ("load_probe_tables", "read_plan"),
    # The function is `loka.dispatch.verify.verify`: `loka.dispatch.verify` is its module.
    "loka.dispatch.verify": ("Verification", "VerifyConfig"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from loka.dispatch.apply_plan import (
        Applied,
        ApplyConfig,
        PlanFallbackWarning,
        PlanMismatchError,
        apply,
    )
    from loka.dispatch.bench import (
        BenchCache,
        BenchResult,
        CacheMismatchError,
        CostModel,
        Shape,
        benchmark,
        site_shapes,
    )
    from loka.dispatch.device import DeviceInfo
    from loka.dispatch.integrations import GuardConfig, RuntimeGuard, Session, SessionConfig
    from loka.dispatch.planner import Plan, PlanConfig, PlanSummary, make_plan
    from loka.dispatch.report import write_report
    from loka.dispatch.tables import load_probe_tables, read_plan
    from loka.dispatch.verify import Verification, VerifyConfig


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(import_module(_MODULE_OF[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loka.dispatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__: list[str] = [
    "Applied",
    "ApplyConfig",
    "BenchCache",
    "BenchResult",
    "CacheMismatchError",
    "CostModel",
    "DeviceInfo",
    "GuardConfig",
    "Plan",
    "PlanConfig",
    "PlanFallbackWarning",
    "PlanMismatchError",
    "PlanSummary",
    "RuntimeGuard",
    "Session",
    "SessionConfig",
    "Shape",
    "Verification",
    "VerifyConfig",
    "apply",
    "benchmark",
    "load_probe_tables",
    "make_plan",
    "read_plan",
    "site_shapes",
    "write_report",
]
