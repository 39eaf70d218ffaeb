"""`Fp8LinearConfig`: the backend and recipe of each pass of a linear (fwd, dgrad, wgrad)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from loka.kernels import registry
from loka.kernels.native import NATIVE_BACKEND, NATIVE_CPU_BACKEND, NATIVE_FAST_BACKEND
from loka.mods.bias_grad import BIAS_GRADS
from loka.schema import BF16, PASSES, Recipe

__all__ = [
    "Fp8LinearConfig",
    "PassConfig",
]


@dataclass(frozen=True)
class PassConfig:
    """One pass: its recipe (a `loka.schema.Recipe` or its string) and the
    registered backend that runs it: of op ``"mm"`` for a linear, ``"grouped_mm"`` for a
    group of linears (None: the highest-priority backend that supports the GEMM on the
    tensors' device, chosen at each call).

    A ``bf16`` recipe keeps the pass in high precision: it runs as ``nn.Linear`` would, in the
    autocast dtype under autocast, else in the input's dtype (so an fp32 model stays fp32).
    """

    recipe: Recipe | str = BF16
    backend: str | None = None

    def __post_init__(self) -> None:
        recipe = Recipe.of(self.recipe)
        object.__setattr__(self, "recipe", recipe)
        if self.backend is None:
            return
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be a registered name or None, got {self.backend!r}")
        try:
            backend = registry.get(self.backend)
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        if backend.op not in ("mm", "grouped_mm"):
            raise ValueError(
                f"backend {self.backend!r} runs op {backend.op!r}, not a GEMM ('mm' for a "
                "linear, 'grouped_mm' for a group)"
            )
        formats = (recipe.a_format, recipe.b_format)
        if formats not in backend.formats:
            raise ValueError(
                f"backend {self.backend!r} cannot run recipe {recipe}: it takes operand formats "
                f"{sorted(backend.formats)}"
            )

    @property
    def is_bf16(self) -> bool:
        return self.recipe.is_bf16

    def __str__(self) -> str:
        return f"{self.recipe}@{self.backend or 'auto'}"


CENTER_BACKENDS = (NATIVE_BACKEND, NATIVE_FAST_BACKEND, NATIVE_CPU_BACKEND)
"""The backends that run a recipe's ``center`` (its mean product rides in the GEMM's bias)."""


def _check_center(pass_: str, config: PassConfig) -> None:
    if pass_ == "wgrad":
        raise ValueError(
            f"wgrad: {config.recipe} centers its first operand over the tokens, and wgrad "
            "reduces over the tokens (center is for fwd and dgrad)"
        )
    if config.backend not in CENTER_BACKENDS:
        raise ValueError(
            f"{pass_}: {config.recipe} runs on a torch-native backend {CENTER_BACKENDS}, named "
            f"in its PassConfig; got {config.backend or 'none (auto)'}"
        )


def _as_pass(value: PassConfig | Recipe | str) -> PassConfig:
    return value if isinstance(value, PassConfig) else PassConfig(value)


@dataclass(frozen=True)
class Fp8LinearConfig:
    """How an `Fp8Linear` computes ``y = x W^T + b`` and its two gradients.

    fwd: ``x W^T`` (operands x, W); dgrad: ``dY W`` (operands dY, W^T); wgrad: ``dY^T x``
    (operands dY^T, x^T). Each field takes a `PassConfig`, or a recipe (or its string) run
    by the default backend. The default is rowwise dynamic e4m3 in every pass (torchao's
    rowwise recipe); ``Fp8LinearConfig.bf16()`` keeps all three passes in high precision.

    pad: pad K and N of the weight (once per optimizer step, in its FP8 copy) and M, K, N of
    activations and gradients (on their FP8 bytes) to the multiples the chosen backends need,
    and slice the results back, so that e.g. ``torch._scaled_mm`` (K, N multiples of 16) runs
    a 479-wide linear. Without it such shapes fail validation.

    bias_grad: how the backward sums dY over the tokens for the bias (`loka.mods.bias_grad`):
    "sum" (a reduction, as `nn.Linear`), "gemm" (``ones @ dY`` on the tensor cores) or
    "split" (under torch.compile, float32 partial sums over blocks of 256 tokens, then over
    the blocks: parallel whatever M is, where inductor leaves a reduction over a symbolic M
    serial).

    tokens_vary: the linear's token count M varies between calls (jagged batches), so a
    compiled graph holds it symbolic; the native backend then takes the tensor amax of
    activations and gradients in two stages (`loka.kernels.native.quantize_native`'s
    `rows_vary`), 2x faster than one reduction over a symbolic M, a little slower over a
    static one. `loka.dispatch.apply` sets it for the sites whose M varied under Probe.

    eager_graphs: in eager mode on a GPU, replay the quantizations of x, dY and the weight
    (the kernel backends', not the torch-native one's) from CUDA graphs captured per input
    layout (`loka.mods.eager_graphs`): one launch each instead of a dozen ops, for the host
    time that decides eager steps. It holds FP8 copies of x and dY per site in graph memory.
    Ignored under torch.compile.
    """

    fwd: PassConfig | Recipe | str = "e4m3:e4m3/row/dynamic"
    dgrad: PassConfig | Recipe | str = "e4m3:e4m3/row/dynamic"
    wgrad: PassConfig | Recipe | str = "e4m3:e4m3/row/dynamic"
    pad: bool = False
    bias_grad: str = "sum"
    tokens_vary: bool = False
    eager_graphs: bool = True

    def __post_init__(self) -> None:
        for pass_ in PASSES:
            object.__setattr__(self, pass_, _as_pass(getattr(self, pass_)))
        if not isinstance(self.pad, bool):
            raise TypeError(f"pad must be a bool, got {self.pad!r}")
        if not isinstance(self.tokens_vary, bool):
            raise TypeError(f"tokens_vary must be a bool, got {self.tokens_vary!r}")
        if not isinstance(self.eager_graphs, bool):
            raise TypeError(f"eager_graphs must be a bool, got {self.eager_graphs!r}")
        if self.bias_grad not in BIAS_GRADS:
            raise ValueError(f"bias_grad must be one of {BIAS_GRADS}, got {self.bias_grad!r}")
        for pass_, config in self.passes().items():
            if config.recipe.center:
                _check_center(pass_, config)

    @classmethod
    def bf16(cls) -> Fp8LinearConfig:
        """Every pass in high precision: the module computes exactly what nn.Linear does."""
        return cls(BF16, BF16, BF16)

    @classmethod
    def from_recipes(
        cls,
        fwd: Recipe | str = "e4m3:e4m3/row/dynamic",
        dgrad: Recipe | str = "e4m3:e4m3/row/dynamic",
        wgrad: Recipe | str = "e4m3:e4m3/row/dynamic",
        *,
        backend: str | None = None,
        pad: bool = False,
    ) -> Fp8LinearConfig:
        """Three recipes with one backend for the FP8 passes (bf16 passes take none)."""

        def make(recipe: Recipe | str) -> PassConfig:
            recipe = Recipe.of(recipe)
            return PassConfig(recipe, None if recipe.is_bf16 else backend)

        return cls(make(fwd), make(dgrad), make(wgrad), pad)

    def passes(self) -> dict[str, PassConfig]:
        return {pass_: getattr(self, pass_) for pass_ in PASSES}

    @property
    def is_bf16(self) -> bool:
        return all(p.is_bf16 for p in self.passes().values())

    def replace(self, **changes: object) -> Fp8LinearConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return Fp8LinearConfig(**values)

    def __str__(self) -> str:
        text = ", ".join(f"{p}={c}" for p, c in self.passes().items())
        text += ", pad" if self.pad else ""
        text += f", bias_grad={self.bias_grad}" if self.bias_grad != "sum" else ""
        text += ", no eager graphs" if not self.eager_graphs else ""
        return text + (", tokens_vary" if self.tokens_vary else "")
