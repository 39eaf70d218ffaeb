"""Recipes: how one GEMM pass runs in FP8 (or stays in bf16), written as a short string.

Grammar: ``bf16`` or ``A:B/granularity/scaling[/pow2][/ub=<max scale>]`` where A and B are
the FP8 formats of the pass's first and second operand (``e4m3`` or ``e5m2``), granularity
is ``tensor``, ``row`` or ``block``, and scaling is ``dynamic`` (scale from the current amax)
or ``delayed<H>`` (scale from the largest amax of the last H steps). ``pow2`` rounds each
scale down to a power of two; ``ub=`` caps the scale.

    >>> Recipe.parse("e5m2:e4m3/tensor/delayed16/pow2")
    Recipe(a_format='e5m2', b_format='e4m3', granularity='tensor', scaling='delayed', history=16, pow2=True, scale_ub=None)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from loka.schema.tables import FP8_FORMATS, GRANULARITIES

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

_DELAYED = re.compile(r"delayed(\d+)")


class RecipeError(ValueError):
    """A recipe string or field that does not follow the grammar."""


@dataclass(frozen=True)
class Recipe:
    a_format: str = "bf16"
    b_format: str = "bf16"
    granularity: str = "none"
    scaling: str = "none"
    history: int = 0
    pow2: bool = False
    scale_ub: float | None = None

    def __post_init__(self) -> None:
        if self.is_bf16:
            if (self.b_format, self.granularity, self.scaling) != ("bf16", "none", "none") or (
                self.history or self.pow2 or self.scale_ub is not None
            ):
                raise RecipeError("a bf16 recipe takes no FP8 options")
            return
        for name, fmt in (("a_format", self.a_format), ("b_format", self.b_format)):
            if fmt not in FP8_FORMATS:
                raise RecipeError(f"{name} must be one of {FP8_FORMATS}, got {fmt!r}")
        if self.granularity not in GRANULARITIES:
            raise RecipeError(
                f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}"
            )
        if self.scaling == "dynamic":
            if self.history:
                raise RecipeError("dynamic scaling keeps no amax history")
        elif self.scaling == "delayed":
            if self.history < 1:
                raise RecipeError("delayed scaling needs an amax history of at least 1 step")
            if self.granularity != "tensor":
                raise RecipeError("delayed scaling is defined for tensorwise scales only")
        else:
            raise RecipeError(f"scaling must be 'dynamic' or 'delayed', got {self.scaling!r}")
        if self.scale_ub is not None and not (math.isfinite(self.scale_ub) and self.scale_ub > 0):
            raise RecipeError(f"scale upper bound must be finite and positive, got {self.scale_ub}")

    @property
    def is_bf16(self) -> bool:
        return self.a_format == "bf16"

    @classmethod
    def parse(cls, text: str) -> Recipe:
        if not isinstance(text, str):
            raise RecipeError(f"a recipe is a string, got {type(text).__name__}")
        text = text.strip()
        if text == "bf16":
            return BF16
        parts = text.split("/")
        if len(parts) < 3:
            raise RecipeError(f"recipe {text!r}: expected 'A:B/granularity/scaling[/pow2][/ub=X]'")
        formats, granularity, scaling, *options = parts
        a_format, sep, b_format = formats.partition(":")
        if not sep:
            raise RecipeError(f"recipe {text!r}: formats must be written 'A:B', e.g. e4m3:e4m3")
        history = 0
        if m := _DELAYED.fullmatch(scaling):
            scaling, history = "delayed", int(m.group(1))
        pow2, scale_ub = False, None
        for opt in options:
            if opt == "pow2" and not pow2:
                pow2 = True
            elif opt.startswith("ub=") and scale_ub is None:
                try:
                    scale_ub = float(opt[3:])
                except ValueError:
                    raise RecipeError(f"recipe {text!r}: bad scale bound {opt!r}") from None
            else:
                raise RecipeError(f"recipe {text!r}: unknown or repeated option {opt!r}")
        try:
            return cls(a_format, b_format, granularity, scaling, history, pow2, scale_ub)
        except RecipeError as exc:
            raise RecipeError(f"recipe {text!r}: {exc}") from None

    def __str__(self) -> str:
        if self.is_bf16:
            return "bf16"
        scaling = f"delayed{self.history}" if self.scaling == "delayed" else self.scaling
        text = f"{self.a_format}:{self.b_format}/{self.granularity}/{scaling}"
        if self.pow2:
            text += "/pow2"
        if self.scale_ub is not None:
            text += f"/ub={self.scale_ub!r}"
        return text


BF16 = Recipe()
