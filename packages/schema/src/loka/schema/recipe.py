"""Recipes: how one GEMM pass runs in FP8 (or stays in bf16), and how each of its two
operands is quantized. The one typed vocabulary of every LoKA package; both types print
to and parse from short strings.

`Recipe` (a pass): ``bf16`` or ``A:B/granularity/scaling[/pow2][/ub=<max scale>][/center]``
where A and B are the FP8 formats of the pass's first and second operand (``e4m3`` or
``e5m2``), granularity is ``tensor``, ``row`` or ``block``, and scaling is ``dynamic`` (scale
from the current amax) or ``delayed<H>`` (scale from the largest amax of the last H steps).
``pow2`` rounds each scale down to a power of two; ``ub=`` caps the scale. ``center``
(dynamic scaling, a pass whose first operand's rows are tokens: fwd, dgrad) takes each
column's mean over the tokens out of the first operand before it is quantized and adds its
product back in high precision, ``A B^T = (A - 1 mu) B^T + 1 (mu B^T)``: FP8 then rounds the
part that varies from token to token, not a vector every token shares.

    >>> Recipe.parse("e5m2:e4m3/tensor/delayed16/pow2")
    Recipe(a_format='e5m2', b_format='e4m3', granularity='tensor', scaling='delayed', history=16, pow2=True, scale_ub=None, center=False)

`QuantConfig` (an operand): ``fmt/granularity[/RxC][/pow2][/ub=<max scale>]``, e.g.
``e4m3/row`` or ``e5m2/block/128x128/pow2``; `Recipe.operands(pass_)` gives the two of a
pass (blocks are 1x128 for activations and gradients, 128x128 for weights). loka.mods passes
this string to its custom ops.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from loka.schema.formats import (
    ACTIVATION_BLOCK,
    BLOCK_SHAPES,
    FP8_FORMATS,
    GRANULARITIES,
    MIN_SCALE_UB,
    PASSES,
    WEIGHT_BLOCK,
    WEIGHT_OPERANDS,
)

__all__ = [
    "BF16",
    "QuantConfig",
    "Recipe",
    "RecipeError",
    "scale_grid",
]

if TYPE_CHECKING:
    import torch

_HIGH = "bf16"  # a pass kept in high precision
_DELAYED = re.compile(r"delayed(\d+)")
_BLOCK = re.compile(r"(\d+)x(\d+)")


class RecipeError(ValueError):
    """A recipe, operand config or format that is not in LoKA's FP8 vocabulary; the message
    names the problem."""


def _check_format(name: str, fmt: object) -> None:
    if fmt not in FP8_FORMATS:
        raise RecipeError(f"{name} must be one of {FP8_FORMATS}, got {fmt!r}")


def _check_granularity(granularity: object) -> None:
    if granularity not in GRANULARITIES:
        raise RecipeError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def _checked_scale_ub(scale_ub: object) -> float | None:
    if scale_ub is None:
        return None
    try:
        ub = float(scale_ub)
    except (TypeError, ValueError):
        ub = math.nan
    if not (math.isfinite(ub) and ub >= MIN_SCALE_UB):
        raise RecipeError(
            "scale upper bound scale_ub must be finite and positive, at least 2**-126 (a "
            f"normal float32), got {scale_ub!r}"
        )
    return ub


def _parse_options(
    text: str, options: list[str], center_allowed: bool = False
) -> tuple[bool, float | None, bool]:
    """(pow2, scale_ub, center) from the trailing ``pow2``, ``ub=X`` (and, for a recipe,
    ``center``) parts of a string."""
    pow2, scale_ub, center = False, None, False
    for opt in options:
        if opt == "pow2" and not pow2:
            pow2 = True
        elif opt == "center" and center_allowed and not center:
            center = True
        elif opt.startswith("ub=") and scale_ub is None:
            try:
                scale_ub = float(opt[3:])
            except ValueError:
                raise RecipeError(f"{text!r}: bad scale bound {opt!r}") from None
        else:
            raise RecipeError(f"{text!r}: unknown or repeated option {opt!r}")
    return pow2, scale_ub, center


def _options_text(pow2: bool, scale_ub: float | None, center: bool = False) -> str:
    return (
        ("/pow2" if pow2 else "")
        + ("" if scale_ub is None else f"/ub={scale_ub!r}")
        + ("/center" if center else "")
    )


def scale_grid(
    rows: int, cols: int, granularity: str, block: tuple[int, int] | None
) -> tuple[int, ...]:
    """Shape of the scales of a ``[rows, cols]`` operand: ``(1,)``, ``(rows,)`` or the grid of
    blocks."""
    if granularity == "tensor":
        return (1,)
    if granularity == "row":
        return (rows,)
    br, bc = block
    return (-(-rows // br), -(-cols // bc))


@dataclass(frozen=True)
class QuantConfig:
    """How one GEMM operand is quantized: FP8 format, granularity (and block shape), and the
    scale options (power-of-two rounding, upper bound). Validated on construction; `block`
    is (1, 128) (the default for granularity 'block') or (128, 128), None otherwise.
    """

    fmt: str = "e4m3"
    granularity: str = "row"
    block: tuple[int, int] | None = None
    pow2: bool = False
    scale_ub: float | None = None

    def __post_init__(self) -> None:
        _check_format("FP8 format fmt", self.fmt)
        _check_granularity(self.granularity)
        block = self.block
        if self.granularity != "block":
            if block is not None:
                raise RecipeError(f"block={block} only applies to granularity 'block'")
        else:
            block = ACTIVATION_BLOCK if block is None else tuple(block)
            if block not in BLOCK_SHAPES:
                raise RecipeError(f"block must be one of {BLOCK_SHAPES}, got {block}")
        object.__setattr__(self, "block", block)
        if not isinstance(self.pow2, bool):
            raise RecipeError(f"pow2 must be a bool, got {type(self.pow2).__name__}")
        object.__setattr__(self, "scale_ub", _checked_scale_ub(self.scale_ub))

    @cached_property
    def dtype(self) -> torch.dtype:
        """The torch dtype of the format (imports torch: `loka.schema.fp8`)."""
        from loka.schema.fp8 import FP8_DTYPES

        return FP8_DTYPES[self.fmt]

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        return scale_grid(rows, cols, self.granularity, self.block)

    @classmethod
    def parse(cls, text: str) -> QuantConfig:
        """The config of its string, e.g. ``e4m3/row`` or ``e5m2/block/128x128/pow2/ub=64.0``."""
        if not isinstance(text, str):
            raise RecipeError(f"an operand config is a string, got {type(text).__name__}")
        return _parse_quant_config(text.strip())

    def __str__(self) -> str:
        text = f"{self.fmt}/{self.granularity}"
        if self.block is not None:
            text += f"/{self.block[0]}x{self.block[1]}"
        return text + _options_text(self.pow2, self.scale_ub)


@functools.lru_cache(maxsize=512)
def _parse_quant_config(text: str) -> QuantConfig:
    # Cached: loka.mods' custom ops read their operand configs from strings on every call.
    parts = text.split("/")
    if len(parts) < 2:
        raise RecipeError(
            f"operand config {text!r}: expected 'fmt/granularity[/RxC][/pow2][/ub=X]'"
        )
    fmt, granularity, *options = parts
    block = None
    if options and (m := _BLOCK.fullmatch(options[0])):
        block = (int(m.group(1)), int(m.group(2)))
        options = options[1:]
    pow2, scale_ub, _ = _parse_options(f"operand config {text}", options)
    try:
        return QuantConfig(fmt, granularity, block, pow2, scale_ub)
    except RecipeError as exc:
        raise RecipeError(f"operand config {text!r}: {exc}") from None


@dataclass(frozen=True)
class Recipe:
    """How one GEMM pass runs. FP8 recipes take scaling ``dynamic`` unless told otherwise
    (``Recipe("e4m3", "e4m3", "row")`` is rowwise dynamic e4m3); ``Recipe()`` is bf16."""

    a_format: str = _HIGH
    b_format: str = _HIGH
    granularity: str = "none"
    scaling: str = "none"
    history: int = 0
    pow2: bool = False
    scale_ub: float | None = None
    center: bool = False

    def __post_init__(self) -> None:
        if self.a_format == _HIGH or self.b_format == _HIGH:
            fp8_options = (self.granularity, self.scaling, self.history, self.pow2, self.scale_ub,
                           self.center)  # fmt: skip
            if (self.a_format, self.b_format) != (_HIGH, _HIGH) or fp8_options != (
                "none", "none", 0, False, None, False,
            ):  # fmt: skip
                raise RecipeError("a bf16 recipe takes no FP8 options (and two bf16 operands)")
            return
        for name, fmt in (("a_format", self.a_format), ("b_format", self.b_format)):
            _check_format(name, fmt)
        _check_granularity(self.granularity)
        if self.scaling == "none":
            object.__setattr__(self, "scaling", "dynamic")
        if self.scaling == "dynamic":
            if self.history:
                raise RecipeError("dynamic scaling keeps no amax history")
        elif self.scaling == "delayed":
            if not isinstance(self.history, int) or self.history < 1:
                raise RecipeError("delayed scaling needs an amax history of at least 1 step")
            if self.granularity != "tensor":
                raise RecipeError("delayed scaling is defined for tensorwise scales only")
        else:
            raise RecipeError(f"scaling must be 'dynamic' or 'delayed', got {self.scaling!r}")
        if not isinstance(self.pow2, bool):
            raise RecipeError(f"pow2 must be a bool, got {type(self.pow2).__name__}")
        if not isinstance(self.center, bool):
            raise RecipeError(f"center must be a bool, got {type(self.center).__name__}")
        if self.center and self.scaling != "dynamic":
            raise RecipeError("center takes dynamic scaling (a delayed amax is of other data)")
        object.__setattr__(self, "scale_ub", _checked_scale_ub(self.scale_ub))

    @property
    def is_bf16(self) -> bool:
        return self.a_format == _HIGH

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    @classmethod
    def parse(cls, text: str) -> Recipe:
        if not isinstance(text, str):
            raise RecipeError(f"a recipe is a string, got {type(text).__name__}")
        return _parse_recipe(text.strip())

    @classmethod
    def of(cls, recipe: Recipe | str) -> Recipe:
        """`recipe` itself, or the recipe its string names."""
        if isinstance(recipe, Recipe):
            return recipe
        if isinstance(recipe, str):
            return _parse_recipe(recipe.strip())
        raise RecipeError(
            f"a recipe is a loka.schema.Recipe or its string, got {type(recipe).__name__}"
        )

    def operand(self, side: str, weight: bool) -> QuantConfig:
        """How operand `side` ("a" or "b") of a pass run with this recipe is quantized; a
        `weight` operand takes 128x128 blocks, others 1x128."""
        if self.is_bf16:
            raise RecipeError("a bf16 recipe quantizes no operand")
        if side not in ("a", "b"):
            raise RecipeError(f"side must be 'a' or 'b', got {side!r}")
        block = None
        if self.granularity == "block":
            block = WEIGHT_BLOCK if weight else ACTIVATION_BLOCK
        fmt = self.a_format if side == "a" else self.b_format
        return QuantConfig(fmt, self.granularity, block, self.pow2, self.scale_ub)

    def operands(self, pass_: str) -> tuple[QuantConfig, QuantConfig]:
        """The configs of the two operands of `pass_` of a linear ``y = x W^T`` (fwd:
        x and W; dgrad: dY and W^T; wgrad: dY^T and x^T)."""
        if pass_ not in PASSES:
            raise RecipeError(f"pass must be one of {PASSES}, got {pass_!r}")
        a_weight, b_weight = WEIGHT_OPERANDS[pass_]
        return self.operand("a", a_weight), self.operand("b", b_weight)

    def __str__(self) -> str:
        if self.is_bf16:
            return _HIGH
        scaling = f"delayed{self.history}" if self.delayed else self.scaling
        text = f"{self.a_format}:{self.b_format}/{self.granularity}/{scaling}"
        return text + _options_text(self.pow2, self.scale_ub, self.center)


BF16 = Recipe()


@functools.lru_cache(maxsize=512)
def _parse_recipe(text: str) -> Recipe:
    if text == _HIGH:
        return BF16
    parts = text.split("/")
    if len(parts) < 3:
        raise RecipeError(
            f"recipe {text!r}: expected 'A:B/granularity/scaling[/pow2][/ub=X][/center]'"
        )
    formats, granularity, scaling, *options = parts
    a_format, sep, b_format = formats.partition(":")
    if not sep:
        raise RecipeError(f"recipe {text!r}: formats must be written 'A:B', e.g. e4m3:e4m3")
    history = 0
    if m := _DELAYED.fullmatch(scaling):
        scaling, history = "delayed", int(m.group(1))
    elif scaling == "none":  # the constructor's default only: a string names its scaling
        raise RecipeError(f"recipe {text!r}: scaling must be 'dynamic' or 'delayed', got 'none'")
    pow2, scale_ub, center = _parse_options(f"recipe {text}", options, center_allowed=True)
    try:
        return Recipe(a_format, b_format, granularity, scaling, history, pow2, scale_ub, center)
    except RecipeError as exc:
        raise RecipeError(f"recipe {text!r}: {exc}") from None
