"""Every benchmark script stands on bench/harness.py and does no work when imported: it
parses its command line in main(argv), never at module level (checked from the sources)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "harness.py")
# Not on the harness: these measure nothing. shipped.py builds loka-dispatch's shipped table
# from recorded runs; profile_summary.py groups a recorded profile's kernel rows. Listed, so
# that a new script cannot slip by.
NOT_ON_HARNESS = {"shipped.py", "profile_summary.py"}


def _module_level_calls(tree: ast.Module) -> list[ast.Call]:
    """Calls run at import: those outside functions, classes and `if __name__ == ...`."""
    calls: list[ast.Call] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            continue
        calls += [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    return calls


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_its_arguments_in_main_only(path):
    for call in _module_level_calls(ast.parse(path.read_text())):
        name = ast.unparse(call.func)
        reads_argv = name.endswith("parse_args") and not call.args
        assert not reads_argv and name != "main", (
            f"{path.name}:{call.lineno}: {ast.unparse(call)} runs at import; call it in main(argv)"
        )


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_uses_the_harness(path):
    tree = ast.parse(path.read_text())
    uses = any(isinstance(n, ast.ImportFrom) and n.module == "harness" for n in ast.walk(tree))
    assert uses or path.name in NOT_ON_HARNESS, f"{path.name} must use bench/harness.py"
