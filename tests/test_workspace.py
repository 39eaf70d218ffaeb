"""The workspace layout promised in CONTRIBUTING.md: one PEP 420 namespace, packages that import."""

import importlib
import importlib.metadata
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {
    "loka-stats": "loka.stats",
    "loka-schema": "loka.schema",
    "loka-zoo": "loka.zoo",
    "loka-kernels": "loka.kernels",
    "loka-probe": "loka.probe",
    "loka-mods": "loka.mods",
    "loka-dispatch": "loka.dispatch",
    "loka-plora": "loka.plora",
    "loka-lordba": "loka.lordba",
    "loka-reprec": "loka.reprec",
}


def test_namespace_has_no_init_file():
    offenders = [
        p.relative_to(ROOT)
        for p in ROOT.glob("**/loka/__init__.py")
        if ".venv" not in p.parts and "target" not in p.parts
    ]
    assert offenders == [], f"loka must stay a PEP 420 namespace; remove {offenders}"


@pytest.mark.parametrize(("distribution", "module"), sorted(PACKAGES.items()))
def test_package_installs_and_imports(distribution, module):
    assert importlib.metadata.version(distribution)
    mod = importlib.import_module(module)
    assert isinstance(mod.__all__, list), f"{module} must list its public API in __all__"
