"""The kernels compile for Hopper (sm_90) with Triton's bundled ptxas, no GPU needed.

The interpreter runs the kernels' logic; this checks what only the compiler sees (types,
layouts, wgmma lowering, software pipelining of the FP8 GEMM's loads), in a subprocess
because this test session runs Triton in interpreter mode.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton


def _ptxas_bundled() -> bool:
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _ptxas_bundled(), reason="this Triton build ships no ptxas to compile with")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("aot_sm90.py")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("OK ") == 11, done.stdout
