"""REPREC's optional dependencies, imported when first needed: `import loka.zoo` (and
`import loka.zoo.reprec`) work with torch alone."""

from __future__ import annotations

import importlib
from types import ModuleType

_HINT = "REPREC needs transformers, peft and loka-mods: pip install transformers peft loka-mods"


def require(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{_HINT} ({error})") from error
