"""The walls between packages, checked from the source (CONTRIBUTING.md, "Layout" and "Public
faces"), with no package imported:

- the "may import" column of CONTRIBUTING's layout table is the dependency graph: it points
  one way, each package's pyproject requires exactly the loka packages it names (those marked
  "extra" through an optional dependency), and every `loka.*` import in a package's `src/`
  is of the package itself or one that it names;
- a package imports from another only public names: those in the other's top-level
  `__all__`, or in the `__all__` of a submodule listed in its `__public_modules__`.
"""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib
from dataclasses import dataclass, field

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = {
    "stats": ("rust", "rust/python/loka/stats"),
    "schema": ("packages/schema", "packages/schema/src/loka/schema"),
    "zoo": ("packages/zoo", "packages/zoo/src/loka/zoo"),
    "kernels": ("kernels", "kernels/src/loka/kernels"),
    "probe": ("packages/probe", "packages/probe/src/loka/probe"),
    "mods": ("packages/mods", "packages/mods/src/loka/mods"),
    "dispatch": ("packages/dispatch", "packages/dispatch/src/loka/dispatch"),
    "plora": ("packages/plora", "packages/plora/src/loka/plora"),
    "lordba": ("packages/lordba", "packages/lordba/src/loka/lordba"),
    "reprec": ("packages/reprec", "packages/reprec/src/loka/reprec"),
}
# Calls that import a module named by a string: importlib's, and loka.dispatch.extras.require.
IMPORTING_CALLS = {"import_module", "require"}


def documented_edges() -> dict[str, dict[str, bool]]:
    """package -> {package it may import: whether only through an extra}, from the layout
    table of CONTRIBUTING.md (column "may import", e.g. `schema`, `kernels`, `probe` (extra))."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    edges: dict[str, dict[str, bool]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"`loka-\w+`", cells[1]):
            continue
        name = cells[1].strip("`").removeprefix("loka-")
        edges[name] = {
            m.group(1): bool(m.group(2)) for m in re.finditer(r"`(\w+)`( \(extra\))?", cells[3])
        }
    return edges


def declared_edges(package: str) -> dict[str, bool]:
    """The loka packages `package`'s pyproject requires: {name: only through an extra}."""
    project = tomllib.loads((ROOT / SRC[package][0] / "pyproject.toml").read_text())["project"]
    found: dict[str, bool] = {}
    groups = [(False, project.get("dependencies", []))]
    groups += [(True, deps) for deps in project.get("optional-dependencies", {}).values()]
    for extra, deps in groups:
        for dep in deps:
            m = re.match(r"loka-(\w+)", dep)
            if m and m.group(1) != package:
                found[m.group(1)] = found.get(m.group(1), True) and extra
    return found


def _module_file(module: str) -> pathlib.Path | None:
    parts = module.split(".")
    base = ROOT / SRC[parts[1]][1]
    path = base.joinpath(*parts[2:])
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _literal(path: pathlib.Path, name: str) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        value = getattr(node, "value", None)
        if value is not None and any(getattr(t, "id", None) == name for t in targets):
            return list(ast.literal_eval(value))
    return None


@dataclass
class Face:
    """What a package offers the others: module -> its public names."""

    modules: dict[str, set[str]] = field(default_factory=dict)


def public_face(package: str) -> Face:
    top = f"loka.{package}"
    init = _module_file(top)
    assert init is not None, top
    names = _literal(init, "__all__")
    assert names is not None, f"{top} must list its public names in a literal __all__"
    face = Face({top: set(names)})
    for sub in _literal(init, "__public_modules__") or []:
        module = f"{top}.{sub}"
        path = _module_file(module)
        assert path is not None, f"{top}.__public_modules__ names {sub!r}, which does not exist"
        sub_names = _literal(path, "__all__")
        assert sub_names is not None, f"{module} is public: it must define a literal __all__"
        face.modules[module] = set(sub_names)
    return face


@dataclass(frozen=True)
class Use:
    """One name of another package that a source file uses (name None: the module itself)."""

    file: str
    line: int
    module: str
    name: str | None

    def __str__(self) -> str:
        what = self.module if self.name is None else f"{self.module}.{self.name}"
        return f"{self.file}:{self.line}: {what}"


def uses_of_others(package: str) -> list[Use]:
    found: list[Use] = []
    root = ROOT / SRC[package][1]
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # `import loka.zoo as zoo`: zoo -> loka.zoo
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    found.append(Use(rel, node.lineno, node.module, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    found.append(Use(rel, node.lineno, a.name, None))
                    if a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.Call) and node.args:
                func = getattr(node.func, "attr", getattr(node.func, "id", None))
                arg = node.args[0]
                if func in IMPORTING_CALLS and isinstance(arg, ast.Constant):
                    found.append(Use(rel, node.lineno, str(arg.value), None))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                found.append(Use(rel, node.lineno, aliases[node.value.id], node.attr))
    return [
        u
        for u in found
        if u.module.startswith("loka.") and u.module.split(".")[1] not in (package, "__main__")
    ]


def is_public(use: Use, face: Face) -> bool:
    if use.name is None:  # `import loka.x.sub`: the package or a public module
        return use.module in face.modules
    if use.module in face.modules and use.name in face.modules[use.module]:
        return True
    # `from loka.zoo.data import amazon`, where `loka.zoo.data.amazon` is a public module
    return f"{use.module}.{use.name}" in face.modules


def test_layout_table_names_every_package():
    assert set(documented_edges()) == set(SRC)


def test_documented_dependencies_point_one_way():
    edges = documented_edges()
    order: list[str] = []
    visiting: set[str] = set()

    def visit(pkg: str, path: tuple[str, ...]) -> None:
        assert pkg not in visiting, f"dependency cycle: {' -> '.join((*path, pkg))}"
        if pkg in order:
            return
        visiting.add(pkg)
        for dep in edges[pkg]:
            visit(dep, (*path, pkg))
        visiting.discard(pkg)
        order.append(pkg)

    for pkg in edges:
        visit(pkg, ())
    assert edges["zoo"] == {}, "DESIGN.md: zoo depends only on torch"
    users = {pkg for deps in edges.values() for pkg in deps}
    assert not users & {"plora", "lordba", "reprec"}, "nothing may use the products on top"


@pytest.mark.parametrize("package", sorted(SRC))
def test_pyproject_requires_what_contributing_documents(package):
    assert declared_edges(package) == documented_edges()[package], (
        f"loka-{package}'s pyproject and the 'may import' column of CONTRIBUTING.md disagree"
    )


@pytest.mark.parametrize("package", sorted(SRC))
def test_imports_follow_the_documented_directions(package):
    allowed = documented_edges()[package]
    wrong = [str(u) for u in uses_of_others(package) if u.module.split(".")[1] not in allowed]
    assert wrong == [], f"loka.{package} may import only {sorted(allowed)}: {wrong}"


@pytest.mark.parametrize("package", sorted(SRC))
def test_imports_only_public_names(package):
    faces: dict[str, Face] = {}
    wrong = []
    for use in uses_of_others(package):
        other = use.module.split(".")[1]
        if other not in faces:
            faces[other] = public_face(other)
        if not is_public(use, faces[other]):
            wrong.append(str(use))
    assert wrong == [], (
        f"loka.{package} uses names that are not public (CONTRIBUTING.md, 'Public faces'): {wrong}"
    )


# The LoKA layers whose faces issue 17 cut to about ten names; the rest is in public modules.
SMALL_FACES = ("kernels", "mods", "dispatch")


@pytest.mark.parametrize("package", sorted(SRC))
def test_public_face_is_well_formed(package):
    face = public_face(package)  # every public module exists and lists its names
    top = face.modules[f"loka.{package}"]
    if package in SMALL_FACES:
        assert len(top) <= 12, f"loka.{package} exports {len(top)} names: keep about ten"
