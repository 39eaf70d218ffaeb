"""The backend registry: what can run which GEMM, at which shapes, on which device.

A `Backend` declares an op (``"mm"``: one NT GEMM ``out = a @ b.T``; ``"grouped_mm"``; or an
op added by another kernel family), the operand formats and scaling granularities it takes,
the passes of a linear it may serve, alignment constraints on the GEMM's dims, the GPU
capability it needs, a callable with the op's uniform signature and a pure-torch reference
with the same signature. `Backend.supports` refuses, with a reason, anything it would run
wrong; `Registry.available` lists what may be timed for speed on a device (a real GPU;
Triton's CPU interpreter runs kernels for tests but is never "available").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loka.kernels.formats import check_pass
from loka.kernels.runtime import (
    FP8_MIN_CAPABILITY,
    capability,
    resolve_device,
    triton_unavailable_reason,
)
from loka.schema import FP8_FORMATS, PASSES, Recipe

__all__ = [
    "BF16",
    "Backend",
    "GemmSpec",
    "OperandSpec",
    "Registry",
    "UnsupportedError",
    "available",
    "gemm_dims",
    "registry",
]

BF16 = "bf16"


class UnsupportedError(RuntimeError):
    """A backend was asked for something it does not support; the message says why."""


def gemm_dims(pass_: str, M: int, K: int, N: int) -> tuple[int, int, int]:
    """(m, k, n) of the NT GEMM ``out[m, n] = a[m, k] @ b[n, k]^T`` for a pass of ``y = x W^T``.

    fwd ``x[M,K] W[N,K]^T``: (M, K, N); dgrad ``dY[M,N] (W^T)[K,N]^T``: (M, N, K);
    wgrad ``(dY^T)[N,M] (x^T)[K,M]^T``: (N, M, K).
    """
    check_pass(pass_)
    return {"fwd": (M, K, N), "dgrad": (M, N, K), "wgrad": (N, M, K)}[pass_]


@dataclass(frozen=True)
class OperandSpec:
    fmt: str  # "e4m3", "e5m2", or "bf16" for a high-precision operand
    granularity: str = "none"  # "tensor", "row", "block"; "none" for high precision
    block: tuple[int, int] | None = None

    @classmethod
    def of(cls, t: Any) -> OperandSpec:
        """The spec of an operand: an `Fp8Tensor` or a high-precision tensor."""
        if isinstance(t, torch.Tensor):
            return cls(BF16)
        return cls(t.fmt, t.granularity, t.block)


@dataclass(frozen=True)
class GemmSpec:
    """One NT GEMM ``out[m, n] = a[m, k] @ b[n, k]^T`` as a backend sees it."""

    m: int
    k: int
    n: int
    a: OperandSpec
    b: OperandSpec
    out_dtype: torch.dtype = torch.bfloat16
    bias: bool = False
    activation: str | None = None
    pass_: str | None = None
    pow2: bool = False
    scale_ub: bool = False

    @classmethod
    def for_linear(cls, recipe: Recipe, pass_: str, M: int, K: int, N: int, **kw: Any) -> GemmSpec:
        """The GEMM of one pass of a linear ``x[M,K] W[N,K]^T`` run with `recipe`."""
        m, k, n = gemm_dims(pass_, M, K, N)
        if recipe.is_bf16:
            a = b = OperandSpec(BF16)
        else:
            a, b = (OperandSpec(c.fmt, c.granularity, c.block) for c in recipe.operands(pass_))
        return cls(
            m, k, n, a, b, pass_=pass_, pow2=bool(recipe.pow2),
            scale_ub=recipe.scale_ub is not None, **kw,
        )  # fmt: skip

    @classmethod
    def of(
        cls, a: Any, b: Any, *, bias: bool = False, activation: str | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> GemmSpec:  # fmt: skip
        """The spec of actual operands (`Fp8Tensor` or high-precision tensors)."""
        (m, k), (n, _) = a.shape, b.shape
        return cls(m, k, n, OperandSpec.of(a), OperandSpec.of(b), out_dtype, bias, activation)


@dataclass(frozen=True)
class Backend:
    """One implementation of an op. See the package README, "Adding a backend"."""

    name: str
    op: str
    run: Callable[..., Any]
    reference: Callable[..., Any]
    description: str
    formats: frozenset[tuple[str, str]]
    granularities: frozenset[str]
    passes: frozenset[str] = frozenset(PASSES)
    pow2: bool = True  # accepts power-of-two scales
    scale_ub: bool = True  # accepts scales capped by an upper bound
    align: tuple[tuple[str, int], ...] = ()  # (GEMM dim "m"/"k"/"n", multiple)
    min_capability: tuple[int, int] | None = FP8_MIN_CAPABILITY
    triton: bool = False  # a Triton kernel: also runs under TRITON_INTERPRET=1 on CPU
    runs_on_cpu: bool = False  # plain torch ops that also run (slowly) on CPU
    fused_epilogue: bool = False  # bias and activation applied inside the kernel
    # Quantization and GEMM in plain torch ops, run inside the model's own graph: under
    # torch.compile inductor fuses the quantization with its neighbours (`loka.kernels.native`).
    traceable: bool = False
    # Runs a recipe's `center` (fwd, dgrad): the first operand's token mean taken out before
    # quantizing, its product added back in the GEMM's bias (`loka.mods.native_function`).
    centers: bool = False
    # A linear on this backend zero-pads its GEMM dims to `align` itself (exact: the torch-
    # native linear does), so `supports` takes any linear shape; its GEMM alone (`refuse`,
    # `fp8_mm`) still needs them aligned.
    linear_pads: bool = False
    # A padded twin of another backend (with `linear_pads`): refused where a linear's dims
    # are aligned already, since there it would run (and be timed as) the same GEMM.
    pads_only: bool = False
    scalings: frozenset[str] = frozenset({"dynamic", "delayed"})
    priority: int = 0  # default choice among backends that support a request: highest first
    check: Callable[[GemmSpec], str | None] | None = None  # further constraints
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def runs_bf16(self) -> bool:
        """Whether it multiplies bf16 operands (a baseline: torch.bf16, inductor.bf16)."""
        return (BF16, BF16) in self.formats

    def refuse(self, spec: GemmSpec) -> str | None:
        """Why this backend cannot run `spec` (None when it can)."""
        if spec.pass_ is not None and spec.pass_ not in self.passes:
            return f"{self.name}: pass {spec.pass_!r} not supported (only {sorted(self.passes)})"
        fmts = (spec.a.fmt, spec.b.fmt)
        if fmts not in self.formats:
            return (
                f"{self.name}: operand formats {fmts} not supported (only {sorted(self.formats)})"
            )
        for side in (spec.a, spec.b):
            if side.fmt != BF16 and side.granularity not in self.granularities:
                return f"{self.name}: granularity {side.granularity!r} not supported (only {sorted(self.granularities)})"
        if spec.pow2 and not self.pow2:
            return f"{self.name}: power-of-two scales not supported"
        if spec.scale_ub and not self.scale_ub:
            return f"{self.name}: scale upper bounds not supported"
        dims = {"m": spec.m, "k": spec.k, "n": spec.n}
        for dim, multiple in self.align:
            if dims[dim] % multiple:
                return f"{self.name}: GEMM dim {dim}={dims[dim]} must be a multiple of {multiple}"
        return self.check(spec) if self.check is not None else None

    def supports(self, recipe: Recipe, M: int, K: int, N: int, pass_: str = "fwd") -> str | None:
        """None if this backend can run `pass_` of a linear ``x[M,K] W[N,K]^T`` with `recipe`
        (a `loka.schema.Recipe` or its string), else the reason it cannot."""
        if self.op != "mm":
            return f"{self.name}: op {self.op!r} is not a linear's GEMM"
        recipe = Recipe.of(recipe)
        if not recipe.is_bf16 and recipe.scaling not in self.scalings:
            return (
                f"{self.name}: {recipe.scaling} scaling not supported "
                f"(only {sorted(self.scalings)})"
            )
        if recipe.center and not self.centers:
            return f"{self.name}: does not run a recipe's center (the torch-native backends do)"
        if recipe.center and pass_ == "wgrad":
            return f"{self.name}: center is for fwd and dgrad (wgrad reduces over the tokens)"
        dims = self.linear_dims(M, K, N)
        if self.pads_only and dims == (M, K, N):
            return f"{self.name}: dims ({M}, {K}, {N}) are aligned already, nothing to pad"
        return self.refuse(GemmSpec.for_linear(recipe, pass_, *dims))

    def linear_dims(self, M: int, K: int, N: int) -> tuple[int, int, int]:
        """The dims a linear ``x[M,K] W[N,K]^T`` on this backend multiplies at: its own, or
        padded up to `align` where the linear pads them itself (`linear_pads`)."""
        if not self.linear_pads:
            return M, K, N
        multiple = math.lcm(1, *(m for _, m in self.align))
        return tuple(-(-d // multiple) * multiple for d in (M, K, N))

    def unavailable_reason(self, device: torch.device | str | None = None) -> str | None:
        """Why this backend cannot be timed for speed on `device` (None when it can)."""
        device = resolve_device(device)
        if device.type != "cuda":
            return f"{self.name}: speed needs a CUDA GPU, device is {device.type}"
        if self.triton:
            return triton_unavailable_reason(device, self.min_capability)
        cap = capability(device)
        if self.min_capability is not None and (cap is None or cap < self.min_capability):
            need = ".".join(map(str, self.min_capability))
            return f"{self.name}: needs compute capability {need}+, device has {cap}"
        return None

    def runnable_reason(self, device: torch.device | str) -> str | None:
        """Why this backend cannot run on `device` at all, even slowly (None when it can)."""
        device = torch.device(device)
        if device.type == "cpu":
            if self.triton:
                return triton_unavailable_reason(device, None)
            return None if self.runs_on_cpu else f"{self.name}: does not run on CPU"
        return self.unavailable_reason(device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class Registry:
    """Backends by name. `register` adds one; names are unique unless ``replace=True``."""

    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}
        self._version = 0  # bumped by every change, so callers may cache their choices

    @property
    def version(self) -> int:
        """A number that changes whenever a backend is registered or unregistered."""
        return self._version

    def register(self, backend: Backend, *, replace: bool = False) -> Backend:
        if not isinstance(backend, Backend):
            raise TypeError(f"register takes a Backend, got {type(backend).__name__}")
        if backend.name in self._backends and not replace:
            raise ValueError(f"backend {backend.name!r} is already registered (pass replace=True)")
        for fmt_pair in backend.formats:
            for fmt in fmt_pair:
                if fmt != BF16 and fmt not in FP8_FORMATS:
                    raise ValueError(f"backend {backend.name!r}: unknown format {fmt!r}")
        self._backends[backend.name] = backend
        self._version += 1
        return backend

    def unregister(self, name: str) -> None:
        self.get(name)
        del self._backends[name]
        self._version += 1

    def get(self, name: str) -> Backend:
        try:
            return self._backends[name]
        except KeyError:
            raise KeyError(f"no backend {name!r}; registered: {sorted(self._backends)}") from None

    def backends(self, op: str | None = None) -> list[Backend]:
        """Registered backends (of `op`, if given), highest priority first."""
        found = [b for b in self._backends.values() if op is None or b.op == op]
        return sorted(found, key=lambda b: (-b.priority, b.name))

    def names(self, op: str | None = None) -> list[str]:
        return [b.name for b in self.backends(op)]

    def available(
        self, device: torch.device | str | None = None, op: str | None = None
    ) -> list[str]:
        """Names of the backends that can be timed for speed on `device` (default: current)."""
        return [b.name for b in self.backends(op) if b.unavailable_reason(device) is None]

    def select(self, spec: GemmSpec, device: torch.device | str, op: str = "mm") -> Backend:
        """The highest-priority backend that runs `spec` on `device`, or UnsupportedError
        listing why each one refused."""
        reasons = []
        for backend in self.backends(op):
            reason = backend.runnable_reason(device) or backend.refuse(spec)
            if reason is None:
                return backend
            reasons.append(reason)
        raise UnsupportedError(f"no {op} backend runs this request: " + "; ".join(reasons))


registry = Registry()


def available(device: torch.device | str | None = None, op: str | None = None) -> list[str]:
    """Backends that can be timed for speed on `device`: ``registry.available``."""
    return registry.available(device, op)
