"""Optional dependencies and the extra of loka-dispatch that installs each one.

A feature whose package is missing says so in one line naming the extra to install, rather
than a traceback: `MissingExtraError` carries that line, and the `loka` command prints it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Top-level module -> (distribution that provides it, extra of loka-dispatch that installs it).
OPTIONAL: dict[str, tuple[str, str]] = {
    "loka.zoo": ("loka-zoo", "zoo"),
    "loka.probe": ("loka-probe", "probe"),
    "lightning": ("lightning", "lightning"),
    "transformers": ("transformers", "hf"),
    "peft": ("peft", "hf"),
}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that installs it."""


def extra_for(module: str | None) -> tuple[str, str] | None:
    """(distribution, extra) of the optional module `module` or of a package above it."""
    while module:
        if module in OPTIONAL:
            return OPTIONAL[module]
        module = module.rpartition(".")[0]
    return None


def install_hint(module: str, feature: str, extra: str | None = None) -> str:
    """One line: what `feature` needs and how to install it (`extra` instead of the module's
    own extra, e.g. `demo`, which brings loka-probe and loka-zoo together)."""
    found = extra_for(module)
    if found is None:
        return f"{feature} needs the Python module {module}, which is not installed"
    dist, own = found
    return f"{feature} needs {dist}: pip install 'loka-dispatch[{extra or own}]'"


def explain(exc: ImportError, feature: str, extra: str | None = None) -> MissingExtraError | None:
    """The one-line error for `exc` when it is a missing optional package (None otherwise)."""
    if isinstance(exc, MissingExtraError):
        return exc
    if isinstance(exc, ModuleNotFoundError) and extra_for(exc.name) is not None:
        return MissingExtraError(install_hint(exc.name or "", feature, extra), name=exc.name)
    return None


def require(module: str, feature: str) -> ModuleType:
    """Import `module` or raise `MissingExtraError` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        explained = explain(exc, feature)
        if explained is None:
            raise
        raise explained from None
