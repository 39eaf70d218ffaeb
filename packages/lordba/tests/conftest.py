"""The sign-GEMM kernels run on CPU through Triton's interpreter: TRITON_INTERPRET must be set
before any `@triton.jit` function is created, so it is set here, before the test modules
import loka.lordba (bench/lordba.py exercises the compiled kernels on a GPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
