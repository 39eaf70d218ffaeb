"""`Fp8Tensor`: FP8 data with the scales that dequantize it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loka.schema.fp8 import FP8_DTYPES, expand_scale
from loka.schema.recipe import scale_grid


@dataclass(frozen=True)
class Fp8Tensor:
    """A 2-D tensor quantized to FP8: ``data = saturate(x * scale)``, ``x ~ data / scale``.

    ``data`` is ``[rows, cols]``, row-major and contiguous. ``scale``, ``inv_scale`` (what a GEMM
    multiplies by) and ``amax`` (the amax observed in ``x`` per scale group, NaN and Inf
    excluded: record it for delayed scaling) are float32 and shaped by the granularity:
    ``tensor`` ``[1]``, ``row`` ``[rows]``, ``block`` ``[ceil(rows/br), ceil(cols/bc)]`` for a
    block of ``(br, bc)``, either ``(1, 128)`` or ``(128, 128)``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    inv_scale: torch.Tensor
    amax: torch.Tensor
    fmt: str
    granularity: str
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FP8_DTYPES or self.data.dtype != FP8_DTYPES[self.fmt]:
            raise TypeError(
                f"Fp8Tensor data is {self.data.dtype}, which is not format {self.fmt!r}"
            )
        if self.data.dim() != 2 or not self.data.is_contiguous():
            raise ValueError(
                f"Fp8Tensor data must be 2-D and contiguous, got shape {tuple(self.data.shape)}"
            )
        expected = scale_grid(*self.data.shape, self.granularity, self.block)
        for name in ("scale", "inv_scale", "amax"):
            t = getattr(self, name)
            if t.dtype != torch.float32 or tuple(t.shape) != expected:
                raise ValueError(
                    f"Fp8Tensor.{name} must be float32 of shape {expected} for granularity "
                    f"{self.granularity!r}, got {t.dtype} {tuple(t.shape)}"
                )

    @classmethod
    def _trusted(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        inv_scale: torch.Tensor,
        amax: torch.Tensor,
        fmt: str,
        granularity: str,
        block: tuple[int, int] | None = None,
    ) -> Fp8Tensor:
        """Construct without the checks: for this package's kernels, whose outputs are made
        to the checked layout (the checks cost more host time than a small quantization)."""
        t = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(t, "data", data)
        setattr_(t, "scale", scale)
        setattr_(t, "inv_scale", inv_scale)
        setattr_(t, "amax", amax)
        setattr_(t, "fmt", fmt)
        setattr_(t, "granularity", granularity)
        setattr_(t, "block", block)
        return t

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def expand_scale(self, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The per-group `scale` (default: ``self.scale``) broadcast to one value per element."""
        s = self.scale if scale is None else scale
        return expand_scale(s, *self.data.shape, self.granularity, self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data / scale`` in `dtype` (computed in float32)."""
        return (self.data.float() / self.expand_scale()).to(dtype)
