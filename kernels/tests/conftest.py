"""Kernel tests run on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before any `@triton.jit` function is created (that is when
Triton decides between compiling and interpreting), so it is set here, at conftest import,
before the test modules import loka.kernels. On a machine with a GPU, run the benchmark
(bench/kernels.py), not these tests, to exercise the compiled kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
