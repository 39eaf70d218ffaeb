"""loka.schema: the contract between LoKA's packages.

The FP8 vocabulary (formats, granularities, passes and constants in `loka.schema.formats`;
`Recipe`, `QuantConfig` and their one error type `RecipeError`; the pure-torch reference
quantization in `loka.schema.fp8`, which needs torch) and the tables: polars schemas of
`sites`, `tensor_stats`, `site_errors`, `kernel_bench` and `plan`, a schema version,
validation with errors that name the file, column and versions, and atomic parquet IO.

The table names are imported on first use, so that importing the vocabulary (what
loka-kernels and loka-mods do) does not load polars.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from loka.schema.atomic import atomic_write
from loka.schema.formats import FP8_FORMATS, FP8_MAX, GRANULARITIES, PASSES, ROLES
from loka.schema.recipe import BF16, QuantConfig, Recipe, RecipeError

_LAZY = {
    "loka.schema.io": ("TableWriteError", "read_metadata", "read_table", "write_table"),
    "loka.schema.sketches": ("SketchRecord", "tensor_stats_from_sketches"),
    "loka.schema.tables": ("SCHEMA_VERSION", "TABLES", "VERDICTS", "Column", "Table", "table"),
    "loka.schema.validation": ("SchemaError", "empty", "validate"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:
    from loka.schema.io import TableWriteError, read_metadata, read_table, write_table
    from loka.schema.sketches import SketchRecord, tensor_stats_from_sketches
    from loka.schema.tables import SCHEMA_VERSION, TABLES, VERDICTS, Column, Table, table
    from loka.schema.validation import SchemaError, empty, validate


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(import_module(_MODULE_OF[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loka.schema' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BF16",
    "FP8_FORMATS",
    "FP8_MAX",
    "GRANULARITIES",
    "PASSES",
    "ROLES",
    "SCHEMA_VERSION",
    "TABLES",
    "VERDICTS",
    "Column",
    "QuantConfig",
    "Recipe",
    "RecipeError",
    "SchemaError",
    "SketchRecord",
    "Table",
    "TableWriteError",
    "atomic_write",
    "empty",
    "read_metadata",
    "read_table",
    "table",
    "tensor_stats_from_sketches",
    "validate",
    "write_table",
]
# Modules whose own `__all__` is public too (CONTRIBUTING.md, "Public faces").
__public_modules__ = (
    "fp8",
    "formats",
    "recipe",
    "tables",
)
