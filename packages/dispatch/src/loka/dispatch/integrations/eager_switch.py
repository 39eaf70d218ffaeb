"""Running a `torch.compile`d model eagerly while hooks watch it, and compiled otherwise.

Dynamo traces a module's hooks into the graph it compiles and does not guard on them
(`torch._dynamo.config.skip_nnmodule_hook_guards`, on by default): a hook added after the
first compiled call is never run by the compiled code, and one present at that call stays
traced in after it is removed. Probe's hooks are `torch.compiler.disable`d, so a model
first compiled while Probe watched it broke its graph at every site, and kept those breaks
after Probe detached: a Session's planned DHEN-like model ran its forward as one graph per
linear (no fusion across them: the FP8 input quantization not fused into the activation
before it), and the bf16 step it was compared with ran fragmented too (`loka demo
--preset xl --compile` on an H100: 49.98 ms bf16 and 45.69 ms planned, where
`bench/realized.py` times a cleanly compiled bf16 step at 31.44 ms; the demo's steps also
sync and draw fresh batches, so that gap is not all fragmentation).

So while hooks watch the model (Probe in the warm-up and re-probes, the runtime guard on
a check step) the `torch.compile` wrapper calls the module it wraps directly, and
otherwise compiles as it would: its first compiled call then traces the model as it runs
from then on, without hooks and with the plan applied. Only this model runs eagerly
(`torch.compiler.set_stance` would switch every compiled function of the process). The
same holds for a model compiled in place (`model.compile()`).
"""

from __future__ import annotations

from torch import nn

__all__ = ["EagerSwitch", "compiled_in_place"]


def compiled_in_place(module: nn.Module) -> bool:
    """Whether `module.compile()` compiled `module` itself (no wrapper)."""
    return getattr(module, "_compiled_call_impl", None) is not None


class EagerSwitch:
    """Switches one compiled module between compiled and eager calls: a `torch.compile(m)`
    wrapper, or a module compiled in place by `m.compile()`."""

    def __init__(self, compiled: nn.Module) -> None:
        self.module = compiled
        if hasattr(compiled, "_orig_mod"):
            # The wrapper's forward is an instance attribute (the compiled callable), which
            # nn.Module's call dispatches to: the wrapped module's own call replaces it.
            self._name, self._eager = "forward", compiled._orig_mod.__call__
        elif compiled_in_place(compiled):
            # nn.Module's call runs `_compiled_call_impl` when it is set, else `_call_impl`.
            self._name, self._eager = "_compiled_call_impl", None
        else:
            raise TypeError(f"not a torch.compile'd module: {type(compiled).__name__}")
        self._compiled = compiled.__dict__.get(self._name)
        self.eager = False

    def set(self, eager: bool) -> None:
        """Eager calls (`eager`) or the compiled ones the module was made with."""
        if eager == self.eager:
            return
        if eager:
            self.module.__dict__[self._name] = self._eager
        elif self._compiled is not None:
            self.module.__dict__[self._name] = self._compiled
        else:
            self.module.__dict__.pop(self._name, None)
        self.eager = eager
