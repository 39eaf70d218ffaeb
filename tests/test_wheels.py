"""The wheels install outside the repository (issue 18): `scripts/build-wheels` writes every
package's wheel, a fresh venv in a temporary folder installs them (the loka packages only
from those files, third-party ones from the uv cache or PyPI), and each package's README
example (or a small smoke where the example trains for a minute) runs there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = ["rust", "packages/schema", "kernels", "packages/mods", "packages/probe",
           "packages/plora", "packages/lordba", "packages/reprec"]  # fmt: skip
# Larger examples (zoo: 40 s, dispatch: 90 s of CPU training): a smaller smoke instead.
SMOKE = textwrap.dedent(
    """
    import loka.zoo as zoo
    from loka.dispatch import make_plan  # noqa: F401
    from loka.dispatch.cli import build_parser

    setup = zoo.create("dhen", "tiny")
    zoo.train(setup, steps=2, lr=3e-3)
    build_parser()
    print("smoke ok")
    """
)


def _uv() -> list[str]:
    found = shutil.which("uv")
    return [found] if found else ["python3", "-m", "uv"]  # as scripts/env.sh installs it


def _readme_example(package: str) -> str:
    text = (ROOT / package / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match, f"{package}/README.md opens with no python example"
    return match.group(1)


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheels_install_and_run_outside_the_repo(tmp_path):
    dist = tmp_path / "dist"
    # A quicker optimisation of the Rust crate than the release profile's fat LTO (1.5 min
    # instead of 3 on 2 cores), in its own target folder so that later runs reuse it: this
    # test is about installing and running, not about speed.
    build_env = {**os.environ, "CARGO_TARGET_DIR": str(ROOT / "rust/target/wheel-test"),
                 "CARGO_PROFILE_RELEASE_LTO": "off", "CARGO_PROFILE_RELEASE_CODEGEN_UNITS": "16",
                 "CARGO_PROFILE_RELEASE_OPT_LEVEL": "1"}  # fmt: skip
    _run([str(ROOT / "scripts" / "build-wheels"), str(dist)], env=build_env, timeout=600)
    wheels = sorted(dist.glob("*.whl"))
    names = {w.name.split("-")[0] for w in wheels}
    assert names == {f"loka_{n}" for n in ("schema", "stats", "zoo", "kernels", "probe", "mods",
                                            "dispatch", "plora", "lordba", "reprec")}  # fmt: skip
    stats = next(w for w in wheels if w.name.startswith("loka_stats"))
    assert "abi3-manylinux" in stats.name, stats.name

    outside = tmp_path / "elsewhere"  # no pyproject above it: uv sees no workspace
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(UV_LINK_MODE="hardlink", UV_PYTHON_DOWNLOADS="never", TRITON_INTERPRET="1")
    venv = outside / "venv"
    _run([*_uv(), "venv", "--quiet", "--python", sys.executable, str(venv)], cwd=outside, env=env)
    python = venv / "bin" / "python"
    # The torch/triton of the lock, so that they come from the uv cache; the loka packages come
    # only from the wheel files just built (named by path, the index never sees their names).
    constraints = outside / "constraints.txt"
    constraints.write_text("torch==2.11.0\ntriton==3.6.0\n")
    _run(
        [*_uv(), "pip", "install", "--quiet", "--python", str(python), "-c", str(constraints),
         "--find-links", str(dist), *map(str, wheels), "loka-dispatch[demo]", "loka-plora[yaml,hf]", "loka-lordba", "loka-reprec"],
        cwd=outside, env=env, timeout=600,
    )  # fmt: skip

    script = ["import runpy, loka.schema, loka.dispatch",
              f"assert loka.schema.__file__.startswith({str(venv)!r}), loka.schema.__file__",
              "assert loka.dispatch.__file__.startswith(" + repr(str(venv)) + ")"]  # fmt: skip
    for package in READMES:
        example = outside / f"example_{package.replace('/', '_')}.py"
        example.write_text(_readme_example(package))
        script.append(f"runpy.run_path({str(example)!r}, run_name='__main__')")
        script.append(f"print('example ok: {package}')")
    (outside / "smoke.py").write_text(SMOKE)
    script.append(f"runpy.run_path({str(outside / 'smoke.py')!r}, run_name='__main__')")
    proc = _run([str(python), "-c", "\n".join(script)], cwd=outside, env=env, timeout=600)
    assert proc.stdout.count("example ok") == len(READMES)
    assert "smoke ok" in proc.stdout
    _run([str(venv / "bin" / "loka"), "--help"], cwd=outside, env=env, timeout=120)
    # Subcommands of the other packages, found through their installed entry points.
    for command in ("lora-plan", "reprec"):
        _run([str(venv / "bin" / "loka"), command, "--help"], cwd=outside, env=env, timeout=120)
