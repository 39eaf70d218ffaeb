"""loka.kernels imports without the optional Triton features (issue 18): the TMA GEMM's host
tensor descriptors (Triton >= 3.4) are imported when it launches, not at import time."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# A Triton without `triton.tools.tensor_descriptor`: None in sys.modules fails its import.
# Compiled mode (no TRITON_INTERPRET): Triton's own interpreter imports that module.
SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton.tools.tensor_descriptor"] = None
    import torch
    import loka.kernels, loka.mods, loka.dispatch
    from loka.kernels.fp8_gemm_tma import tma_refusal, tma_supported
    assert not tma_supported()
    reason = tma_refusal(128, 128, torch.bfloat16)
    assert reason.startswith("the TMA GEMM needs triton>=3.4"), reason
    print("ok")
    """
)


def test_kernels_import_without_tensor_descriptors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_tma_supported_on_this_triton():
    import triton

    from loka.kernels.fp8_gemm_tma import tma_supported

    major_minor = tuple(int(v) for v in triton.__version__.split(".")[:2])
    assert tma_supported() == (major_minor >= (3, 4))
