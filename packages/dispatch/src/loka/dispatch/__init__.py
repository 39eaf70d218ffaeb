"""loka.dispatch: benchmark kernels, plan each GEMM site, apply the plan, keep it honest.

    tables = probe.tables()                                # loka.probe, or load_probe_tables
    bench = benchmark(site_shapes(tables["sites"]), cost_model=CostModel.shipped()).table
    plan = make_plan(tables["sites"], tables["site_errors"], bench)
    applied = apply(model, plan)                           # applied.undo() reverses it
    model = torch.compile(model, options=compile_options())  # multi-kernel reductions

After `apply`, `loka.dispatch.verify.verify(step_fn, applied)` times the real step against
bf16 and demotes sites until the plan is not slower. In a training loop: `Session(model, SessionConfig(...))`
and `session.step()` after each optimizer step (it verifies too); `LokaCallback` (Lightning) and `LokaTrainerCallback` (Hugging Face) live in
`loka.dispatch.integrations.lightning` / `.hf`.

The rest of the public API is in the modules of `__public_modules__` (`VerifyConfig` in
`loka.dispatch.verify`, `write_report` in `loka.dispatch.report`, ...). Names are imported
on first use, so that `loka --help` and the CLI's light commands do not load torch, Triton
and matplotlib.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "loka.dispatch.apply_plan": ("Applied", "apply"),
    "loka.dispatch.bench": ("CostModel", "benchmark", "site_shapes"),
    "loka.dispatch.compile_options": ("compile_options",),
    "loka.dispatch.integrations": ("Session", "SessionConfig"),
    "loka.dispatch.planner": ("Plan", "PlanConfig", "make_plan"),
    "loka.dispatch.tables": ("load_probe_tables",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from loka.dispatch.apply_plan import Applied, apply
    from loka.dispatch.bench import CostModel, benchmark, site_shapes
    from loka.dispatch.compile_options import compile_options
    from loka.dispatch.integrations import Session, SessionConfig
    from loka.dispatch.planner import Plan, PlanConfig, make_plan
    from loka.dispatch.tables import load_probe_tables


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
    "CostModel",
    "Plan",
    "PlanConfig",
    "Session",
    "SessionConfig",
    "apply",
    "benchmark",
    "compile_options",
    "load_probe_tables",
    "make_plan",
    "site_shapes",
]
# Modules whose own `__all__` is public too (CONTRIBUTING.md, "Public faces").
__public_modules__ = (
    "apply_plan",
    "bench",
    "compile_options",
    "device",
    "integrations",
    "integrations.hf",
    "integrations.lightning",
    "planner",
    "report",
    "tables",
    "verify",
)
