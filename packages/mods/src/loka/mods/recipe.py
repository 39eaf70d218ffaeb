"""Recipes as `loka.mods` reads them: any object with `loka.schema.Recipe`'s fields, or the
recipe string of the shared vocabulary (``bf16`` or ``A:B/granularity/scaling[/pow2][/ub=X]``).

loka.mods does not depend on loka.schema: `as_recipe` copies the fields of whatever it is
given (``loka.schema.Recipe``, ``loka.kernels.KernelRecipe``, this module's `Fp8Recipe`) into
an `Fp8Recipe`, and parses strings itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from loka.kernels import QuantConfig

BF16 = "bf16"
_RECIPE_TEXT = re.compile(
    r"(?P<a>\w+):(?P<b>\w+)/(?P<granularity>\w+)/(?P<scaling>dynamic|delayed(?P<history>\d+))"
    r"(?P<options>(?:/[^/]+)*)"
)


class RecipeError(ValueError):
    """A recipe that does not follow the grammar or names an unknown option."""


@dataclass(frozen=True)
class Fp8Recipe:
    """How one GEMM pass is computed: the FP8 formats of its two operands (or bf16), the
    scaling granularity, dynamic or delayed (amax history of `history` calls) scales, and the
    scale options (power-of-two rounding, upper bound). Field names are `loka.schema.Recipe`'s.
    """

    a_format: str = BF16
    b_format: str = BF16
    granularity: str = "none"
    scaling: str = "none"
    history: int = 0
    pow2: bool = False
    scale_ub: float | None = None

    def __post_init__(self) -> None:
        if self.a_format == BF16 or self.b_format == BF16:
            fp8_options = (self.granularity, self.scaling, self.history, self.pow2, self.scale_ub)
            if (self.a_format, self.b_format) != (BF16, BF16) or fp8_options != (
                "none", "none", 0, False, None,
            ):  # fmt: skip
                raise RecipeError(f"a bf16 recipe takes no FP8 options, got {self!r}")
            return
        try:  # formats, granularity and scale options: the kernels' own checks
            for fmt in (self.a_format, self.b_format):
                QuantConfig(fmt, self.granularity, None, self.pow2, self.scale_ub)
        except (TypeError, ValueError) as exc:
            raise RecipeError(str(exc)) from None
        if self.scaling not in ("dynamic", "delayed"):
            raise RecipeError(f"scaling must be 'dynamic' or 'delayed', got {self.scaling!r}")
        if (self.scaling == "delayed") != (self.history > 0):
            raise RecipeError(
                f"{self.scaling} scaling with an amax history of {self.history}: delayed "
                "scaling needs one of at least 1 step, dynamic scaling none"
            )
        if self.delayed and self.granularity != "tensor":
            raise RecipeError(
                f"delayed scaling is defined for tensorwise scales only, got {self.granularity!r}"
            )

    @property
    def is_bf16(self) -> bool:
        return self.a_format == BF16

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    def __str__(self) -> str:
        if self.is_bf16:
            return BF16
        parts = [
            f"{self.a_format}:{self.b_format}",
            self.granularity,
            f"delayed{self.history}" if self.delayed else "dynamic",
        ]
        if self.pow2:
            parts.append("pow2")
        if self.scale_ub is not None:
            parts.append(f"ub={self.scale_ub:g}")
        return "/".join(parts)


BF16_RECIPE = Fp8Recipe()


def parse_recipe(text: str) -> Fp8Recipe:
    """`Fp8Recipe` from its string, e.g. ``e4m3:e4m3/row/dynamic`` or
    ``e5m2:e4m3/tensor/delayed16/pow2/ub=1024``; ``bf16`` for a pass kept in high precision."""
    if not isinstance(text, str):
        raise RecipeError(f"a recipe string must be a str, got {type(text).__name__}")
    stripped = text.strip()
    if stripped == BF16:
        return BF16_RECIPE
    match = _RECIPE_TEXT.fullmatch(stripped)
    if match is None:
        raise RecipeError(
            f"recipe {text!r} does not read as 'bf16' or 'A:B/granularity/scaling[/pow2][/ub=X]' "
            "(scaling: dynamic or delayedH)"
        )
    pow2, scale_ub = False, None
    for option in filter(None, match["options"].split("/")):
        if option == "pow2" and not pow2:
            pow2 = True
        elif option.startswith("ub=") and scale_ub is None:
            try:
                scale_ub = float(option[3:])
            except ValueError:
                raise RecipeError(
                    f"recipe {text!r}: scale bound {option!r} is not a number"
                ) from None
        else:
            raise RecipeError(f"recipe {text!r}: unknown or repeated option {option!r}")
    history = int(match["history"]) if match["history"] else 0
    scaling = "delayed" if match["history"] else "dynamic"
    try:
        return Fp8Recipe(
            match["a"], match["b"], match["granularity"], scaling, history, pow2, scale_ub
        )
    except RecipeError as exc:
        raise RecipeError(f"recipe {text!r}: {exc}") from None


def as_recipe(recipe: Any) -> Fp8Recipe:
    """An `Fp8Recipe` from a string or any recipe-like object (fields `a_format`, `b_format`,
    `granularity`, and optionally `scaling` (default dynamic), `history`, `pow2`, `scale_ub`)."""
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, str):
        return parse_recipe(recipe)
    try:
        a_format, b_format = recipe.a_format, recipe.b_format
        granularity = recipe.granularity
    except AttributeError:
        raise RecipeError(
            "a recipe must be a string or have a_format, b_format and granularity, got "
            f"{type(recipe).__name__}"
        ) from None
    if a_format == BF16 or b_format == BF16:
        return Fp8Recipe(a_format, b_format)
    scaling = getattr(recipe, "scaling", "dynamic")
    return Fp8Recipe(
        a_format,
        b_format,
        granularity,
        "dynamic" if scaling in (None, "none") else scaling,
        int(getattr(recipe, "history", 0) or 0),
        bool(getattr(recipe, "pow2", False)),
        getattr(recipe, "scale_ub", None),
    )
