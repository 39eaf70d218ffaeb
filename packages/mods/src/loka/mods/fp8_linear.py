"""`Fp8Linear`: a drop-in `nn.Linear` whose fwd, dgrad and wgrad each run in FP8 (their own
backend and recipe) or in high precision; `convert_to_fp8_linear` and `convert_to_linear`.

The module has exactly nn.Linear's parameters (``weight``, ``bias``) and, with dynamic
scaling, exactly its state_dict; delayed scaling adds its amax histories as buffers
(``amax_history_input``, ``amax_history_weight``, ``amax_history_grad_output``), which a
state_dict without them (an nn.Linear's) may omit: they then start empty.

The weight's FP8 copies (W for fwd, W^T for dgrad) live in a cache that is re-made when the
weight changed: its version counter (bumped by every optimizer step, ``load_state_dict`` and
in-place edit) and data pointer are compared at each forward, inside a custom op, so the
check and the refresh also run in compiled graphs (`loka.mods.ops`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loka.mods import checkpointing
from loka.mods.alignment import check_shape
from loka.mods.config import Fp8LinearConfig
from loka.mods.eager_graphs import EagerGraphs
from loka.mods.linear_function import Fp8LinearFunction
from loka.mods.linear_plan import LinearPlan
from loka.mods.native_function import (
    NativeFp8LinearFunction,
    NativePlan,
    quantize_weight,
    quantized_weight_forward,
)
from loka.mods.ops import call, decode, refresh_weight_eager
from loka.mods.sharding import base_class, fsdp_managed, swap_base_class
from loka.mods.weight_stamp import weight_stamp
from loka.schema.fp8 import scale_from_amax
from loka.schema.recipe import scale_grid

__all__ = [
    "Fp8Linear",
    "convert_to_fp8_linear",
    "convert_to_linear",
    "prequantize_weights",
    "release_eager_graphs",
    "release_prequantized_weights",
]

_NO_STAMP = (-1, -1, -1)  # the weight cache was never filled


HISTORY_BUFFERS = ("amax_history_input", "amax_history_weight", "amax_history_grad_output")
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would compute in: the autocast dtype under autocast, else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def multiplied_input(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` as an FP8 linear quantizes it: under autocast an input can arrive in float32 (a
    LayerNorm's output), and what nn.Linear multiplies (and Probe measured) is its cast to
    the autocast dtype. `dtype`: `compute_dtype(x)` where the caller has it."""
    dtype = compute_dtype(x) if dtype is None else dtype
    return x.to(dtype) if x.dtype != dtype and dtype in _HALF_DTYPES else x


class Fp8Linear(nn.Linear):
    """``y = x W^T + b`` with each pass as `config` (an `Fp8LinearConfig`) says.

    Build one from an existing linear with `Fp8Linear.from_linear(linear, config)` (the same
    Parameter objects, so optimizers and their state keep working) or with
    `convert_to_fp8_linear`. Works under autocast (high-precision passes run in the autocast
    dtype; FP8 passes are unaffected) and torch.compile (no graph breaks).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        config: Fp8LinearConfig | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp8(config or Fp8LinearConfig())

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8LinearConfig | None = None) -> Fp8Linear:
        """An Fp8Linear computing with `linear`'s own weight and bias Parameters."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.train(linear.training)
        new._init_fp8(config or Fp8LinearConfig())
        return new

    @classmethod
    def in_place(cls, linear: nn.Linear, config: Fp8LinearConfig | None = None) -> Fp8Linear:
        """`linear` itself made an Fp8Linear: its class swapped, nothing else replaced. For a
        linear whose identity matters: one that FSDP2 manages (`loka.mods.sharding`), which
        sets the unsharded weights on this very object. `to_linear` swaps it back."""
        if base_class(linear) is not nn.Linear:
            raise TypeError(f"in_place needs an nn.Linear, got {type(linear).__name__}")
        config = config or Fp8LinearConfig()
        NativePlan.of(config)  # raises, before any change, on a bad native config
        check_shape(config, linear.in_features, linear.out_features, type(linear).__name__)
        previous = swap_base_class(linear, cls)
        try:
            linear._init_fp8(config)
        except BaseException:
            _strip_fp8_state(linear)
            linear.__class__ = previous
            raise
        linear._linear_class = previous
        return linear

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding this module's weight and bias Parameters. In place (this
        module itself, its class swapped back) for one made by `in_place`, and for one that
        FSDP2 came to manage since (sharded after conversion): FSDP fills this object."""
        previous = vars(self).get("_linear_class")
        if previous is not None or fsdp_managed(self):
            _strip_fp8_state(self)
            if previous is None:
                swap_base_class(self, nn.Linear)
            else:
                self.__class__ = previous
            return self
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight = self.weight
        linear.register_parameter("bias", self.bias)
        linear.train(self.training)
        return linear

    # --- configuration and caches -----------------------------------------------------------

    def _init_fp8(self, config: Fp8LinearConfig) -> None:
        if not isinstance(config, Fp8LinearConfig):
            raise TypeError(f"config must be an Fp8LinearConfig, got {type(config).__name__}")
        check_shape(config, self.in_features, self.out_features, type(self).__name__)
        native = NativePlan.of(config)  # raises, before any change, on a bad native config
        self.fp8_config = config
        self.plan = LinearPlan.of(config)
        # The torch-native backend: quantization traced into the caller's graph, no cache.
        self.native_plan = native
        self._prequantized: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prequantized_stamp: tuple[int, int, int] | None = None
        self._input_amax: float | None = None  # static input scale (serving), see below
        self._input_scale: tuple[torch.Tensor, torch.Tensor] | None = None
        # CUDA graphs of the eager quantizations (kernel backends only; None: off).
        self.eager_graphs = EagerGraphs() if config.eager_graphs and native is None else None
        device = self.weight.device
        windows = {
            "amax_history_input": self.plan.input_window,
            "amax_history_weight": self.plan.weight_window,
            "amax_history_grad_output": self.plan.grad_window,
        }
        for name, window in windows.items():
            if name in self._buffers:
                del self._buffers[name]
            if window:
                self.register_buffer(name, torch.zeros(window, device=device))
        self._allocate_weight_cache()

    def _history(self, name: str) -> torch.Tensor:
        found = self._buffers.get(name)
        return found if found is not None else self._no_history

    def _allocate_weight_cache(self) -> None:
        """Empty FP8 copies of W (fwd layout) and W^T (dgrad layout) on the weight's device,
        and a key that matches no weight, so the next forward fills them."""
        device = self.weight.device
        self._no_history = torch.zeros(0, device=device)
        self._weight_key = torch.full((3,), -1, dtype=torch.int64)
        self._weight_stamp = _NO_STAMP
        N, K = self.out_features, self.in_features
        _, Kp, Np = self.plan.multiples.pad(1, K, N)
        cache: list[torch.Tensor] = []
        for text, rows, cols in ((self.plan.fwd_w, Np, Kp), (self.plan.dgrad_wt, Kp, Np)):
            if not text or self.native_plan is not None:
                cache += [torch.empty(0, device=device) for _ in range(4)]
                continue
            config = decode(text)
            grid = scale_grid(rows, cols, config.granularity, config.block)
            cache.append(torch.empty((rows, cols), dtype=config.dtype, device=device))
            cache += [torch.empty(grid, device=device) for _ in range(3)]
        self._weight_cache = cache

    def gemm_weights(self) -> tuple[torch.Tensor, ...]:
        """What the GEMMs read of the cache: (W data, W inverse scales, W^T data, W^T
        inverse scales); empty tensors for a layout whose pass is not FP8."""
        cache = self._weight_cache
        return cache[0], cache[2], cache[4], cache[6]

    def set_config(self, config: Fp8LinearConfig) -> None:
        """Run with another config from the next call on (e.g. demote a site to bf16); the
        Parameters stay, amax histories of the new config start empty."""
        self._init_fp8(config)

    def _graphs_for(self, x: torch.Tensor) -> EagerGraphs | None:
        """The eager graphs this call may use: None under torch.compile, on the CPU and
        inside another CUDA graph capture."""
        graphs = self.eager_graphs
        if graphs is None or torch.compiler.is_compiling() or not graphs.usable(x):
            return None
        return graphs

    def refresh_weight_cache(self) -> None:
        """Re-make the weight's FP8 copies now if the weight changed (forward does this too)."""
        plan = self.plan
        if not (plan.fwd_w or plan.dgrad_wt) or self.native_plan is not None:
            return
        compiling = torch.compiler.is_compiling()
        if not compiling:
            # Eager: a Python comparison instead of reading the key tensor, made before the
            # refresh's arguments are (the weight is unchanged on most calls), and the new
            # copies replace the cache's entries (no copy kernels; `refresh_weight_eager`).
            stamp = weight_stamp(self.weight)
            if stamp == self._weight_stamp:
                return
            rerun = torch.is_grad_enabled() and checkpointing.in_backward()
            if self._weight_stamp != _NO_STAMP and rerun:
                # Activation checkpointing's rerun of a forward that filled the cache: no
                # optimizer step came between, so the cache holds this weight. The stamp
                # differs only because FSDP2 gathered the weight anew; re-made, the copy
                # recorded the weight's amax twice a step (delayed scaling drifted).
                return
            self._weight_stamp = stamp
        _, Kp, Np = plan.multiples.pad(1, self.in_features, self.out_features)
        args = (self.weight, self._weight_key, self._weight_cache,
                self._history("amax_history_weight"), *plan.weight_layouts, Np, Kp)  # fmt: skip
        if compiling:
            call("refresh_weight", *args)
            return
        refresh_weight_eager(*args, graphs=self._graphs_for(self.weight))

    def _apply(self, fn: Callable, recurse: bool = True) -> Fp8Linear:
        super()._apply(fn, recurse)
        # The cache is not a buffer (module.to(dtype) must not cast FP8 bytes): re-made on
        # the weight's new device at the next forward; a prequantized copy at once.
        self._allocate_weight_cache()
        if self.eager_graphs is not None:  # graphs read the old device's memory
            self.eager_graphs = EagerGraphs(self.eager_graphs.max_graphs)
        if self._prequantized is not None:
            amax = self._input_amax
            self.prequantize_weight()
            if amax is not None:  # the static input scale follows the weight's device
                self.set_static_input_amax(amax)
        return self

    # --- serving: the weight quantized once --------------------------------------------------

    def prequantize_weight(self) -> bool:
        """Quantize the weight for the forward pass once, for serving: every later forward
        that needs no weight gradient multiplies this FP8 copy (what inductor's freezing
        folds into constants, here without freezing the whole model, embedding tables and
        all). For a linear on the torch-native backend with an FP8 forward; the other
        backends cache their FP8 weights already. Returns whether a copy was made.

        A forward that trains the weight (grad enabled, weight requiring grad) raises: call
        `release_prequantized_weight()` first. A weight changed since (an optimizer step, an
        in-place write, another Parameter) makes an eager forward raise; a compiled graph
        cannot check, so call this again after changing the weight (`load_state_dict` and
        `module.to(...)` do). A weight that FSDP2 shards is not prequantized (each forward
        gathers it anew): serve an unsharded copy of the model."""
        fwd = None if self.native_plan is None else self.native_plan.fwd
        if fwd is None or fsdp_managed(self):
            return False
        self._prequantized = quantize_weight(self.weight, fwd)
        for t in self._prequantized:
            # Not a buffer (module.to(dtype) must not cast FP8 bytes): tell CUDA graphs its
            # address is fixed, as a buffer's is, or every replay copies it in first.
            torch._dynamo.mark_static_address(t)
        self._prequantized_stamp = weight_stamp(self.weight)
        return True

    def release_prequantized_weight(self) -> None:
        """Drop the prequantized copy (and any static input scale): every forward quantizes
        the weight, and its input, again."""
        self._prequantized = self._prequantized_stamp = None
        self._input_amax = self._input_scale = None

    def set_static_input_amax(self, amax: float | None) -> None:
        """Serve with a fixed input scale, the one `amax` sets (the forward recipe's format,
        power-of-two and upper-bound rules), instead of measuring each input's amax: the
        quantization is then elementwise, and under torch.compile it fuses into the work
        that produced the input (an activation) in one pass, with no reduction. Inputs above
        `amax` saturate to the format's largest value. For a prequantized weight only (it is
        dropped with it); None returns to dynamic scales. `calibrate_input_scales`
        (`loka.mods.static_scales`) sets it from calibration batches."""
        if amax is None:
            self._input_amax = self._input_scale = None
            return
        if self._prequantized is None:
            raise ValueError(
                f"{type(self).__name__}({self.in_features} -> {self.out_features}): a static "
                "input scale serves a prequantized weight; call prequantize_weight() first"
            )
        amax = float(amax)
        if not (0.0 < amax < float("inf")):
            raise ValueError(f"static input amax must be finite and > 0, got {amax}")
        fwd = self.native_plan.fwd
        if fwd.center:
            raise ValueError(
                f"{type(self).__name__}({self.in_features} -> {self.out_features}): a centering "
                f"forward ({self.fp8_config.fwd.recipe}) measures each batch's mean; a static "
                "input scale is for the input as it comes (use a recipe without center)"
            )
        scale = scale_from_amax(torch.tensor(amax, device=self.weight.device), fwd.a_fmt,
                                fwd.pow2, fwd.scale_ub)  # fmt: skip
        self._input_amax, self._input_scale = amax, (scale, scale.reciprocal())
        for t in self._input_scale:
            torch._dynamo.mark_static_address(t)

    @property
    def static_input_amax(self) -> float | None:
        """The amax behind the static input scale (None: dynamic scales)."""
        return self._input_amax

    @property
    def prequantized(self) -> bool:
        return self._prequantized is not None

    def _serve(self, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The prequantized forward of `x2d`, or None where the call needs gradients through
        the input or bias only (the weight frozen): the usual path, quantizing the weight."""
        if torch.is_grad_enabled() and self.weight.requires_grad:
            raise RuntimeError(
                f"{type(self).__name__}({self.in_features} -> {self.out_features}): the weight "
                "is prequantized for serving and this forward would train it; call "
                "release_prequantized_weight() (loka.mods.release_prequantized_weights) first"
            )
        if torch.is_grad_enabled() and (
            x2d.requires_grad or (self.bias is not None and self.bias.requires_grad)
        ):
            return None
        if (
            not torch.compiler.is_compiling()
            and weight_stamp(self.weight) != self._prequantized_stamp
        ):
            raise RuntimeError(
                f"{type(self).__name__}({self.in_features} -> {self.out_features}): the weight "
                "changed since prequantize_weight(); call it again to serve the new weight"
            )
        wq, w_inv = self._prequantized
        return quantized_weight_forward(
            x2d, wq, w_inv, self.bias, self.native_plan.fwd, dtype, self.out_features,
            input_scale=self._input_scale, weight=self.weight,
        )  # fmt: skip

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # An nn.Linear's state_dict has no amax history: delayed scaling then starts empty.
        for name in HISTORY_BUFFERS:
            if prefix + name in missing_keys:
                missing_keys.remove(prefix + name)
        if self._prequantized is not None:  # the loaded weight is the one to serve
            self.prequantize_weight()

    # --- forward ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan.all_high_precision:
            return F.linear(x, self.weight, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__}: input has {x.shape[-1]} features, expected "
                f"{self.in_features} (input shape {tuple(x.shape)})"
            )
        dtype = compute_dtype(x)
        # From a float32 input every amax and cast pass reads twice the bytes, and the wgrad's
        # transposed one is not fused with the norm: on Wukong xl (compiled) the norm-fed
        # linears' wgrad passes lost 2.5% of the step though timed 1.07x in isolation.
        # The cast's backward returns the input gradient in float32, as autocast's does.
        x2d = multiplied_input(x.reshape(-1, self.in_features), dtype)
        if self._prequantized is not None:
            served = self._serve(x2d, dtype)
            if served is not None:
                return served.view(*x.shape[:-1], self.out_features)
        if self.native_plan is not None:
            y = NativeFp8LinearFunction.apply(
                x2d, self.weight, self.bias, self.native_plan, dtype,
                torch.is_grad_enabled() and self.weight.requires_grad,
            )  # fmt: skip
            return y.view(*x.shape[:-1], self.out_features)
        self.refresh_weight_cache()
        input_history, graphs = self._history("amax_history_input"), self._graphs_for(x2d)
        if self.plan.input_window and torch.is_grad_enabled():
            input_history, graphs = self._checkpointed(input_history, graphs)
        y = Fp8LinearFunction.apply(
            x2d, self.weight, self.bias, self.plan, dtype,
            torch.is_grad_enabled() and self.weight.requires_grad,
            input_history, self._history("amax_history_grad_output"), graphs,
            *self.gemm_weights(),
        )  # fmt: skip
        return y.view(*x.shape[:-1], self.out_features)

    def _checkpointed(
        self, history: torch.Tensor, graphs: EagerGraphs | None
    ) -> tuple[torch.Tensor, EagerGraphs | None]:
        """Delayed input scaling under activation checkpointing (`loka.mods.checkpointing`).
        The forward that checkpointing reruns inside the backward must quantize x with the
        scale its first run took, and must not record x's amax twice: it did both, which
        shifted the history twice a step and quantized the remade activations at another
        scale, so training drifted from the same run without checkpointing. The first run
        keeps a copy of the input history as it found it; the rerun quantizes against that
        copy, and its record goes into the copy. Compiled graphs recompute inside the graph,
        not through this forward."""
        if torch.compiler.is_compiling():
            return history, graphs
        frame, rerun = checkpointing.region()
        if frame is None:
            return history, graphs
        kept = checkpointing.kept_before_rerun(frame, self)
        if rerun:
            return (kept.pop(0) if kept else history.clone()), None
        kept.append(history.clone())
        return history, graphs

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, config=({self.fp8_config})"


# What `_init_fp8` adds to an nn.Linear (and `in_place` records), dropped by an in-place undo.
_FP8_STATE = (
    "fp8_config", "plan", "native_plan", "_prequantized", "_prequantized_stamp", "_input_amax",
    "_input_scale", "eager_graphs", "_no_history", "_weight_key", "_weight_stamp",
    "_weight_cache", "_linear_class",
)  # fmt: skip


def _strip_fp8_state(module: nn.Module) -> None:
    for name in HISTORY_BUFFERS:
        module._buffers.pop(name, None)
    for name in _FP8_STATE:
        vars(module).pop(name, None)


def _matches(module: nn.Module) -> bool:
    # Exactly nn.Linear (or FSDP2's wrapper of it): subclasses (e.g. MultiheadAttention's
    # out_proj, which is read as a weight and never called) may not go through forward.
    return base_class(module) is nn.Linear


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def convert_to_fp8_linear(
    model: nn.Module,
    config: Fp8LinearConfig | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` of `model` (for which ``module_filter_fn(module, fqn)`` is
    true, if given) by an `Fp8Linear` sharing its Parameters; returns the model (a new module
    when `model` is itself an nn.Linear). Every shape is checked against the backends first:
    on an error nothing is replaced. `convert_to_linear` reverses it."""
    config = config or Fp8LinearConfig()
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if _matches(module) and (module_filter_fn is None or module_filter_fn(module, name))
    ]
    for name, module in targets:
        check_shape(config, module.in_features, module.out_features, name or "model")
    NativePlan.of(config)  # raises on a bad native config before any module changes
    # An FSDP2-managed linear changes in place (`loka.mods.sharding`), the others are swapped.
    in_place = [(n, m) for n, m in targets if fsdp_managed(m)]
    swapped = {n: Fp8Linear.from_linear(m, config) for n, m in targets if not fsdp_managed(m)}
    for _, module in in_place:
        Fp8Linear.in_place(module, config)
    if "" in swapped:
        return swapped[""]
    for name, new in swapped.items():
        _swap(model, name, new)
    return model


def convert_to_linear(model: nn.Module) -> nn.Module:
    """Replace every `Fp8Linear` (exactly that class, or FSDP2's wrapper of it) by an
    nn.Linear sharing its Parameters; one converted in place goes back in place."""
    if base_class(model) is Fp8Linear:
        return model.to_linear()
    targets = [(n, m) for n, m in model.named_modules() if base_class(m) is Fp8Linear]
    for name, module in targets:
        plain = module.to_linear()
        if plain is not module:
            _swap(model, name, plain)
    return model


def prequantize_weights(model: nn.Module) -> list[str]:
    """`Fp8Linear.prequantize_weight` on every `Fp8Linear` of `model` (for serving); the
    names of those that made a copy (torch-native, FP8 forward)."""
    return [
        n for n, m in model.named_modules() if isinstance(m, Fp8Linear) and m.prequantize_weight()
    ]


def release_prequantized_weights(model: nn.Module) -> list[str]:
    """Drop every prequantized weight copy in `model` (before training it again); the names
    of the modules that had one."""
    released = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear) and module.prequantized:
            module.release_prequantized_weight()
            released.append(name)
    return released


def release_eager_graphs(model: nn.Module) -> int:
    """Drop the eager CUDA graphs of every `Fp8Linear` in `model` (`loka.mods.eager_graphs`)
    and the GPU memory they hold; later eager calls capture again as needed. Returns how
    many graphs were dropped."""
    dropped = 0
    for module in model.modules():
        graphs = module.eager_graphs if isinstance(module, Fp8Linear) else None
        if graphs is not None:
            dropped += len(graphs)
            module.eager_graphs = EagerGraphs(graphs.max_graphs)
    return dropped
