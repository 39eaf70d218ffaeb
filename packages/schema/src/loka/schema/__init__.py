"""loka.schema: the tables that join LoKA's packages.

Polars schemas of `sites`, `tensor_stats`, `site_errors`, `kernel_bench` and `plan`, a
schema version, validation with errors that name the file, column and versions, atomic
parquet IO, and the recipe grammar.
"""

from loka.schema.atomic import atomic_write
from loka.schema.io import TableWriteError, read_metadata, read_table, write_table
from loka.schema.recipe import BF16, FP8_MAX, Recipe, RecipeError
from loka.schema.sketches import SketchRecord, tensor_stats_from_sketches
from loka.schema.tables import (
    FP8_FORMATS,
    GRANULARITIES,
    PASSES,
    ROLES,
    SCHEMA_VERSION,
    TABLES,
    VERDICTS,
    Column,
    Table,
    table,
)
from loka.schema.validate import SchemaError, empty, validate

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
