"""Backport of triton-lang/triton#9172 for Triton's CPU interpreter under NumPy >= 2.4.

Triton 3.6's interpreter turns a scalar tensor into a Python int with ``int(array)`` where the
array has shape (1,); NumPy 2.4 made that a TypeError, so every ``for i in range(0, n, B)``
over a runtime bound fails under TRITON_INTERPRET=1 (upstream issue #9171). This re-registers
``tensor.__index__`` the way the upstream fix does. It is applied only when interpreting and
only when the installed interpreter still has the bug; compiled kernels are untouched.
"""

from __future__ import annotations

import numpy as np


def _index_is_broken() -> bool:
    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def apply() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_loka_index_backport", False) or not _index_is_broken():
        return
    original = interpreter._patch_lang_tensor

    def index(self) -> int:
        return int(self.handle.data.reshape(-1)[0])

    def patch_lang_tensor(tensor, scope=None) -> None:
        if scope is None:  # Triton 3.4/3.5 set the attributes on the class directly
            original(tensor)
            tensor.__index__ = index
            return
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", index)

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._loka_index_backport = True
