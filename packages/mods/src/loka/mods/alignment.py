"""Shape alignment: which multiples a linear's M, K and N must be padded to for its backends,
and the check that some backend runs every FP8 pass of a linear at its shape.

The passes of ``y = x W^T`` are NT GEMMs over different dims of the linear (see
`loka.kernels.registry.gemm_dims`): a backend that needs its GEMM's k to be a multiple of 16 needs K
in fwd, N in dgrad and M (the tokens) in wgrad. Padding with zeros is exact: zero rows and
columns add nothing to any product, and the results are sliced back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loka.kernels import Backend, registry
from loka.mods.config import Fp8LinearConfig, PassConfig

# Which dim of the linear each GEMM dim (m, k, n) is, per pass.
LINEAR_DIM_OF = {
    "fwd": {"m": "M", "k": "K", "n": "N"},
    "dgrad": {"m": "M", "k": "N", "n": "K"},
    "wgrad": {"m": "N", "k": "M", "n": "K"},
}
# M is unknown before the first batch; validation assumes it is a multiple of this, and
# padding (when on) makes it one at run time.
_PROBE_M = 128


class ShapeError(ValueError):
    """No registered backend runs a pass of a linear at its shape (the message says why)."""


@dataclass(frozen=True)
class Multiples:
    """The multiples M, K and N are padded to (1: not padded)."""

    M: int = 1
    K: int = 1
    N: int = 1

    def pad(self, M: int, K: int, N: int) -> tuple[int, int, int]:
        return (-(-M // self.M) * self.M, -(-K // self.K) * self.K, -(-N // self.N) * self.N)


def _fp8_candidates(config: PassConfig) -> list[Backend]:
    if config.backend is not None:
        return [registry.get(config.backend)]
    return [b for b in registry.backends("mm") if not b.runs_bf16]


def required_multiples(config: Fp8LinearConfig) -> Multiples:
    """Multiples of M, K, N that let every FP8 pass run on its backend (on the highest-priority
    backend supporting the recipe, when the pass names none). All ones unless ``config.pad``."""
    if not config.pad:
        return Multiples()
    need = {"M": 1, "K": 1, "N": 1}
    for pass_, pass_config in config.passes().items():
        if pass_config.is_bf16:
            continue
        for backend in _fp8_candidates(pass_config):
            if backend.supports(pass_config.recipe, *_align_probe(backend), pass_) is not None:
                continue
            for gemm_dim, multiple in backend.align:
                dim = LINEAR_DIM_OF[pass_][gemm_dim]
                need[dim] = math.lcm(need[dim], multiple)
            break
    return Multiples(**need)


def _align_probe(backend: Backend) -> tuple[int, int, int]:
    """A linear shape (M, K, N) that meets every alignment the backend has, to ask it whether
    it takes a recipe at all."""
    multiple = math.lcm(1, *(m for _, m in backend.align))
    return (_PROBE_M * multiple, 16 * multiple, 16 * multiple)


def check_shape(config: Fp8LinearConfig, K: int, N: int, name: str = "linear") -> None:
    """Raise `ShapeError` naming `name`, the pass and every backend's reason unless each FP8 pass
    of a ``[*, K] -> [*, N]`` linear runs on some registered backend (after padding, when
    ``config.pad``). Devices are not checked: this validates a plan on any machine."""
    multiples = required_multiples(config)
    M, Kp, Np = multiples.pad(_PROBE_M * multiples.M, K, N)
    for pass_, pass_config in config.passes().items():
        if pass_config.is_bf16:
            continue
        reasons = []
        for backend in _fp8_candidates(pass_config):
            reason = backend.supports(pass_config.recipe, M, Kp, Np, pass_)
            if reason is None:
                break
            reasons.append(reason)
        else:
            hint = "" if config.pad else " (pad=True, the align mod, pads K and N to fit)"
            raise ShapeError(
                f"{name!r}: no backend runs {pass_} of a linear K={K}, N={N} with recipe "
                f"{pass_config.recipe}{hint}: " + "; ".join(reasons)
            )
