"""Which norm feeds each site, and which op computed its input: the `norm` and `producer`
columns of `sites`, what the planner reads to weigh fusing a norm into the linear after it
(loka.mods' `NormLinear`) and, in a compiled plan, the input's quantization into the op that
computed it (inductor fuses it there).

On its first sampled step Probe watches every LayerNorm/RMSNorm and every linear (sites or
not) through forward hooks. A site is fed by norm N when every one of its calls took N's
output (the same tensor) as its input, N ran as often as the site, and no other module
watched took N's output. Hooks see modules only: a norm output that other code also reads
(a residual, say) is not seen here, which is why loka.mods checks a fused model's outputs on
a sample batch before it keeps the fusion.

A site's producer is read from autograd, so it sees functional code too (`F.gelu` in a
forward, not only `nn.GELU`): the node that made the input tensor, through views and dtype
casts, named as the op (`GeluBackward0` -> `gelu`, `NativeLayerNormBackward0` ->
`native_layer_norm`), when every call agreed. An input that needs no gradient (inference, raw
features) has no producer here. A site's `grad_producer` is the op whose backward computes
its output's gradient: autograd's graph is walked from the model's outputs (a forward hook
on the model) to find the consumers of each site's output (`grad_producer`).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loka.probe.capture import Recorder
from loka.probe.sites import SiteSpec

# The norms loka.mods can fuse with the quantization of their output.
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)

# Autograd nodes looked through to the op that computed a site's input: they move no data
# (views) or convert it where the compiled graph fuses the conversion into that op.
_PASS_THROUGH = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                           "ToCopyBackward0"})  # fmt: skip
_NODE_SUFFIX = re.compile(r"Backward\d*$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def _op_name(node: Any) -> str:
    """`GeluBackward0` -> `gelu`, `NativeLayerNormBackward0` -> `native_layer_norm`."""
    return _CAMEL.sub("_", _NODE_SUFFIX.sub("", type(node).__name__)).lower()


def producer_of(tensor: torch.Tensor) -> str | None:
    """The op that computed `tensor`, as autograd recorded it (`gelu`, `native_layer_norm`,
    `addmm`, ...), through views and dtype casts; None for a tensor autograd did not record
    (no gradient needed, or a leaf)."""
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in _PASS_THROUGH:
        node = next((n for n, _ in node.next_functions if n is not None), None)
    if node is None or type(node).__name__ == "AccumulateGrad":
        return None
    return _op_name(node) or None


def _consumers(roots: list[Any]) -> dict[Any, list[Any]]:
    """Node -> the nodes that took its output (its parents in autograd's graph), over the
    graph reachable from `roots`."""
    parents: dict[Any, list[Any]] = defaultdict(list)
    seen, todo = set(), [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                todo.append(child)
    return parents


def grad_producer(node: Any, consumers: dict[Any, list[Any]]) -> str | None:
    """The op whose backward computes the gradient of the output of `node`: its one
    consumer, looked through views, casts and adds (an add passes its gradient on
    unchanged); `add` where several consumers' gradients are summed (autograd's sum is an
    elementwise kernel); None where the output left the graph seen (a model output)."""
    for _ in range(10_000):  # a chain of views and adds ends; the bound guards a cycle
        users = consumers.get(node, [])
        if len(users) != 1:
            return "add" if users else None
        (node,) = users
        if type(node).__name__ not in _PASS_THROUGH and _op_name(node) != "add":
            return _op_name(node) or None
    return None


class NormTrace(Recorder):
    """Records, for one step, which norm's output each watched module took as its input,
    which op made each input, and the autograd nodes of the sites' and the model's outputs
    (whose graph says what consumed each site's output)."""

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
        self.producers: defaultdict[str, set[str | None]] = defaultdict(set)  # module -> ops
        self._site_outputs: list[tuple[str, Any]] = []  # (site, its output's autograd node)
        self._roots: list[Any] = []  # autograd nodes of the model's outputs
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
                if id(module) in site_names:
                    after = self.guard(watched, self._after_site(watched), forward=True)
                    self.handles.append(module.register_forward_hook(after))
        root = self.guard("<model>", self._after_model, forward=True)
        self.handles.append(model.register_forward_hook(root))

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
                self.producers[name].add(producer_of(args[0]))
                hit = self._outputs.get(id(args[0]))
                if hit is not None and hit[1] is args[0]:
                    self.consumers[hit[0]][name] += 1

        return before

    def _after_site(self, name: str) -> Callable[..., None]:
        def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.grad_fn is not None:
                self._site_outputs.append((name, output.grad_fn))

        return after

    def _after_model(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        leaves = torch.utils._pytree.tree_leaves(output)
        self._roots += [t.grad_fn for t in leaves if isinstance(t, torch.Tensor)]

    def output_grad_producers(self) -> dict[str, str]:
        """Site -> the op whose backward computes its output's gradient on every call
        (`grad_producer`), over the graph of the model's outputs."""
        consumers = _consumers(self._roots)
        found: defaultdict[str, set[str | None]] = defaultdict(set)
        for site, node in self._site_outputs:
            found[site].add(grad_producer(node, consumers))
        return {s: next(iter(ops)) for s, ops in found.items() if len(ops) == 1 and None not in ops}

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

    def input_producers(self) -> dict[str, str]:
        """Module -> the op that computed its input on every call (`producer_of`)."""
        return {
            module: next(iter(ops))
            for module, ops in self.producers.items()
            if len(ops) == 1 and None not in ops
        }

    def remove(self) -> None:
        super().remove()
        self._outputs.clear()
