"""The declared torch/triton floors are versions the code is tested on (issue 18).

- every package declares the same torch floor, and the lowest direct versions resolve to it;
- loka.kernels, loka.mods and loka.dispatch import on the Triton floor, and a Triton kernel
  matches its reference there (under the interpreter, as every kernel test runs): a venv
  holding only that Triton, layered over the workspace's environment for everything else."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = sorted([*ROOT.glob("packages/*/pyproject.toml"), ROOT / "kernels/pyproject.toml"])


def _uv() -> list[str]:
    found = shutil.which("uv")
    return [found] if found else ["python3", "-m", "uv"]  # as scripts/env.sh installs it


def _floor(pyproject: Path, name: str) -> str | None:
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        match = re.fullmatch(rf"{name}>=([\d.]+)(;.*)?", requirement.replace(" ", ""))
        if match:
            return match.group(1)
    return None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in re.findall(r"\d+", text)[:2])


def test_every_package_declares_the_same_torch_floor():
    floors = {p.parent.name: _floor(p, "torch") for p in PYPROJECTS}
    floors.pop("schema")  # polars only
    assert len(set(floors.values())) == 1, floors
    import torch

    assert _version(torch.__version__) >= _version(next(iter(floors.values())))


def test_lowest_direct_versions_resolve_to_the_floors(tmp_path):
    kernels = ROOT / "kernels/pyproject.toml"
    proc = subprocess.run(
        [*_uv(), "pip", "compile", "--quiet", "--no-header", "--python-version", "3.11",
         "--python-platform", "x86_64-manylinux_2_28", "--resolution", "lowest-direct",
         str(kernels), str(ROOT / "packages/zoo/pyproject.toml")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pins = dict(re.findall(r"^([\w-]+)==([\w.+]+)", proc.stdout, re.M))
    assert _version(pins["torch"]) == _version(_floor(kernels, "torch"))
    assert _version(pins["triton"]) >= _version(_floor(kernels, "triton"))


CHECK = textwrap.dedent(
    """
    import torch, triton
    print("triton", triton.__version__)
    import loka.kernels as k, loka.mods, loka.dispatch
    from loka.kernels.fp8_gemm import mm_reference
    torch.manual_seed(0)
    a = k.quantize(torch.randn(48, 64), "e4m3", "row")
    b = k.quantize(torch.randn(40, 64), "e4m3", "row")
    out = k.fp8_mm(a, b, backend="triton.fp8", out_dtype=torch.float32)
    torch.testing.assert_close(out, mm_reference(a, b, out_dtype=torch.float32))
    print("floor ok")
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernels_run_on_the_triton_floor(tmp_path):
    floor = _floor(ROOT / "kernels/pyproject.toml", "triton")
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(UV_LINK_MODE="hardlink", UV_PYTHON_DOWNLOADS="never", TRITON_INTERPRET="1")
    subprocess.run([*_uv(), "venv", "--quiet", "--python", sys.executable, str(venv)],
                   check=True, cwd=tmp_path, env=env)  # fmt: skip
    python = venv / "bin" / "python"
    subprocess.run(
        [*_uv(), "pip", "install", "--quiet", "--python", str(python), "--no-deps",
         f"triton=={floor}.0"],
        check=True, cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    # Everything else from the workspace's environment, after the venv's own site-packages.
    site = sysconfig.get_paths()["purelib"]
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(own, "zz_workspace.pth").write_text(f"import site; site.addsitedir({site!r})\n")
    proc = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"triton {floor}" in proc.stdout
    assert "floor ok" in proc.stdout
