"""LoRDBA configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Backend = Literal["auto", "triton", "torch"]
# The fused inference kernel keeps a [BLOCK_M, rank] float32 tile in registers: above this rank
# it would spill, and LoRDBALinear keeps the two-kernel path.
FUSED_MAX_RANK = 64
# The GEMM-epilogue path keeps a [BLOCK_M, rank] float32 tile beside the GEMM's accumulator.
EPILOGUE_MAX_RANK = 64


@dataclass(frozen=True)
class LoRDBAConfig:
    """How a LoRDBA adapter is shaped and trained.

    rank: number of sign rows of A (and sign columns of B).
    input_scale: add the per-input-channel scale ``q`` (K more fp16 values). Off by default:
        the adapter is then ``s * p * (sign(B) @ (m * (sign(A) @ x)))``, 10.65x smaller than
        an fp16 LoRA at hidden 4096, rank 16 (7.99x with ``q``, whose K values cost as much
        as a sign factor). Without ``q`` A's magnitudes are fitted per rank row only: on the
        LoRA factors of ``bench/lordba.py``'s ``fit`` section (hidden 4096, rank 16) the
        relative fit error rose by 0.01-0.08 (to 0.76-0.81 from 0.73-0.75), most where the
        input channels differ in scale.
    scaling: the fixed output multiplier ``s`` (LoRA's ``alpha / r``). Conversion from a LoRA
        folds the LoRA's own scaling into ``p`` and uses 1.0.
    ste_clip: the straight-through estimator passes a sign's gradient to its latent only
        where ``|latent| <= ste_clip * rms(latent at initialization)``. The default,
        ``math.inf``, is the plain (identity) estimator: on small regression tasks trained with
        Adam, clipping at 1.5-3 rms stalled or slowed sign learning (latents that drift past
        the clip stop receiving gradient and their signs freeze).
    backend: ``"triton"`` (sign-GEMM kernels), ``"torch"`` (the pure-torch references) or
        ``"auto"`` (Triton on CUDA tensors, torch elsewhere).
    fused: inference forwards on the Triton kernels run the one-launch ``sign_adapter``
        kernel (down-projection, rank scale and up-projection fused; the ``[M, r]`` rank
        activations never reach memory) where it applies: no gradient needed, a Triton
        backend, rank <= ``FUSED_MAX_RANK``. Elsewhere (training, the torch backend, larger
        ranks) and with ``fused=False`` the two-kernel path runs. Both agree to float32
        rounding (the fused kernel folds ``s`` into the rank activations before the
        up-projection's dot); ``LoRDBALinear.forward_path(x)`` says which path an input takes.
    gemm_epilogue: inference forwards on the Triton kernels over a plain ``nn.Linear`` or an
        ``Fp8WeightOnlyLinear`` base, with bf16/fp16 inputs, run the base GEMM as LoKA's own
        Triton GEMM (``linear_sign_up``) with the adapter's up-projection in its epilogue:
        ``sign_down``, then one GEMM launch for the whole output (the ``[M, N]`` update is
        never written nor read back). Takes precedence over ``fused`` where it applies (no
        gradient needed, a Triton backend, rank <= ``EPILOGUE_MAX_RANK``, no autocast, FP8
        bases on sm_89+). Off by default until it is measured against cuBLAS on a GPU.
    dense_inference: inference forwards (no gradient needed) over any base run the adapter
        as two cuBLAS GEMMs on dense factors in the input's dtype, made from the signs and
        scales once and kept until the adapter changes: ``t = x @ A'^T`` with
        ``A' = sign(A) diag(q)``, then ``base(x) + t @ B'^T`` in one ``addmm`` with
        ``B' = s diag(p) sign(B) diag(m)``. What ships stays bits; the device holds the
        factors as a 16-bit LoRA would (``r (K + N)`` values a linear). ``t`` is rounded to
        the input's dtype between the GEMMs (the sign kernels keep it in float32), as a
        16-bit LoRA rounds ``x A^T``. Takes precedence over ``fused``; not with
        ``gemm_epilogue``.
    """

    rank: int = 16
    input_scale: bool = False
    scaling: float = 1.0
    ste_clip: float = math.inf
    backend: Backend = "auto"
    fused: bool = True
    gemm_epilogue: bool = False
    dense_inference: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRDBAConfig.rank must be a positive int, got {self.rank!r}")
        if not math.isfinite(self.scaling):
            raise ValueError(f"LoRDBAConfig.scaling must be finite, got {self.scaling}")
        if not self.ste_clip > 0:
            raise ValueError(
                f"LoRDBAConfig.ste_clip must be > 0 (inf: plain STE), got {self.ste_clip}"
            )
        if not isinstance(self.fused, bool):
            raise ValueError(f"LoRDBAConfig.fused must be a bool, got {self.fused!r}")
        if not isinstance(self.gemm_epilogue, bool):
            raise ValueError(
                f"LoRDBAConfig.gemm_epilogue must be a bool, got {self.gemm_epilogue!r}"
            )
        if not isinstance(self.dense_inference, bool):
            raise ValueError(
                f"LoRDBAConfig.dense_inference must be a bool, got {self.dense_inference!r}"
            )
        if self.dense_inference and self.gemm_epilogue:
            raise ValueError(
                "LoRDBAConfig: dense_inference and gemm_epilogue are two ways to run the "
                "adapter at inference; choose one"
            )
        if self.backend not in ("auto", "triton", "torch"):
            raise ValueError(
                f"LoRDBAConfig.backend must be 'auto', 'triton' or 'torch', got {self.backend!r}"
            )
