"""Every LoKA package ships `py.typed` (PEP 561), so type checkers read its annotations."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "name",
    ["loka.schema", "loka.stats", "loka.zoo", "loka.kernels", "loka.probe", "loka.mods",
     "loka.dispatch", "loka.plora", "loka.lordba", "loka.reprec"],
)  # fmt: skip
def test_package_has_py_typed(name: str) -> None:
    module = importlib.import_module(name)
    assert (Path(module.__file__).parent / "py.typed").is_file()
