"""Which norm feeds each site: the `norm` column of `sites`, what the planner reads to weigh
fusing a norm into the linear after it (loka.mods' `NormLinear`).

On its first sampled step Probe watches every LayerNorm/RMSNorm and every linear (sites or
not) through forward hooks. A site is fed by norm N when every one of its calls took N's
output (the same tensor) as its input, N ran as often as the site, and no other module
watched took N's output. Hooks see modules only: a norm output that other code also reads
(a residual, say) is not seen here, which is why loka.mods checks a fused model's outputs on
a sample batch before it keeps the fusion.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loka.probe.capture import Recorder
from loka.probe.sites import SiteSpec

# The norms loka.mods can fuse with the quantization of their output.
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)


class NormTrace(Recorder):
    """Records, for one step, which norm's output each watched module took as its input."""

    def __init__(
        self,
        model: nn.Module,
        sites: list[SiteSpec],
        *,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        super().__init__(on_error)
        self.norm_calls: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()  # module -> forward calls
        self.consumers: defaultdict[str, Counter[str]] = defaultdict(
            Counter
        )  # norm -> module -> calls
        # id of a norm's output -> (norm, the tensor, kept alive so that ids stay unique)
        self._outputs: dict[int, tuple[str, torch.Tensor]] = {}
        site_names = {id(spec.module): spec.name for spec in sites}
        for name, module in model.named_modules():
            if isinstance(module, NORM_TYPES):
                hook = self.guard(name, self._after_norm(name), forward=True)
                self.handles.append(module.register_forward_hook(hook))
            elif id(module) in site_names or isinstance(module, nn.Linear):
                watched = site_names.get(id(module), name)
                hook = self.guard(watched, self._before_module(watched), forward=True)
                # Before FSDP2's pre-forward (on a module fully_shard was called on), which
                # passes the inputs through an autograd function: new tensor objects.
                self.handles.append(module.register_forward_pre_hook(hook, prepend=True))

    def _after_norm(self, name: str) -> Callable[..., None]:
        def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self.norm_calls[name] += 1
            if isinstance(output, torch.Tensor):
                self._outputs[id(output)] = (name, output)

        return after

    def _before_module(self, name: str) -> Callable[..., None]:
        def before(module: nn.Module, args: tuple[Any, ...]) -> None:
            self.calls[name] += 1
            if args and isinstance(args[0], torch.Tensor):
                hit = self._outputs.get(id(args[0]))
                if hit is not None and hit[1] is args[0]:
                    self.consumers[hit[0]][name] += 1

        return before

    @property
    def saw_a_forward(self) -> bool:
        return bool(self.calls)

    def feeding_norms(self) -> dict[str, str]:
        """Module -> the norm whose output was its input on every call and went nowhere else."""
        fed = {}
        for norm, consumers in self.consumers.items():
            if len(consumers) != 1:
                continue
            ((module, count),) = consumers.items()
            if count == self.norm_calls[norm] == self.calls[module]:
                fed[module] = norm
        return fed

    def remove(self) -> None:
        super().remove()
        self._outputs.clear()
