"""Initialization of a LoRDBA adapter from a trained LoRA, and how good the fit is.

A LoRA update is ``dW = s * B @ A`` with ``A: [r, K]``, ``B: [N, r]``. LoRDBA keeps each
factor's signs and fits its magnitudes with a rank-one outer product:

    A ~ diag(a_row) sign(A) diag(a_col),    B ~ diag(b_row) sign(B) diag(b_col)

For a fixed sign pattern ``S = sign(A)``, ``|A - (u v^T) * S| = ||A| - u v^T|`` elementwise
(``S * S = 1``), so the best scales in Frobenius norm are the best rank-one approximation of
``|A|``: its leading singular triple ``sigma u v^T``. ``|A|`` is nonnegative, so by
Perron-Frobenius ``u`` and ``v`` can be taken nonnegative: the fit is a valid magnitude. Its
relative residual ``rho_A = ||A - A_hat||_F / ||A||_F`` is the factor's
residual-to-magnitude ratio; ``rho_A = 0`` exactly when ``|A|`` has rank one, and then the
adapter equals the LoRA.

The two inner vectors meet on the rank axis and merge:
``s * B_hat @ A_hat = diag(p) sign(B) diag(m) sign(A) diag(q)`` with ``p = s * b_row``,
``m = b_col * a_row``, ``q = a_col``. With ``input_scale=False`` (the default: no ``q``, see
``LoRDBAConfig``), ``a_col`` is fixed to 1 and ``a_row`` is each row's mean ``|A|`` (the
least-squares fit under that constraint); then ``rho_A`` measures the residual against that
fit, and is 0 (the adapter equals the LoRA, given ``rho_B = 0``) exactly when ``|A|`` is
constant along each row.

How the update's relative error ``||dW - dW_hat|| / ||dW||`` follows the ratios, with
``kappa = ||B|| ||A|| / ||B A||`` (Frobenius norms):

* worst case (sub-multiplicativity): ``error <= kappa * (rho_A + rho_B + rho_A * rho_B)``,
  reported as ``error_bound``;
* typical case: residuals that are not aligned with the other factor shrink by ``1/sqrt(r)``
  when multiplied by it (``E||e^T A||^2 = ||e||^2 ||A||^2 / r`` for isotropic ``e``), giving
  ``error ~ kappa / sqrt(r) * sqrt(rho_A^2 + rho_B^2 + rho_A^2 rho_B^2)``, reported as
  ``predicted_error``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRDBAFit:
    """Signs and channel scales fitted to one LoRA pair, with the quality of the fit.

    ``scale_in`` (q, ``[K]`` or None), ``scale_rank`` (m, ``[r]``), ``scale_out`` (p, ``[N]``)
    are float32; ``latent_a`` / ``latent_b`` are the LoRA factors themselves (their signs are
    the adapter's signs; their values seed straight-through training).
    """

    latent_a: torch.Tensor
    latent_b: torch.Tensor
    scale_in: torch.Tensor | None
    scale_rank: torch.Tensor
    scale_out: torch.Tensor
    residual_ratio_a: float
    residual_ratio_b: float
    reconstruction_error: float
    error_bound: float
    predicted_error: float


def _signs(values: torch.Tensor) -> torch.Tensor:
    return torch.where(values < 0, -1.0, 1.0).to(values.dtype)


def _rank_one_magnitude(factor: torch.Tensor, fit_cols: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Nonnegative ``(row, col)`` with ``outer(row, col)`` the best fit of ``|factor|``."""
    magnitude = factor.abs()
    if not fit_cols:
        return magnitude.mean(dim=1), torch.ones(factor.shape[1], dtype=factor.dtype)
    left, singular, right = torch.linalg.svd(magnitude, full_matrices=False)
    row, col = left[:, 0], right[0]
    if row.sum() < 0:  # the SVD fixes vectors only up to a joint sign
        row, col = -row, -col
    # Perron-Frobenius: the leading pair of a nonnegative matrix is nonnegative; clamp roundoff.
    return row.clamp_min(0) * singular[0], col.clamp_min(0)


def _relative_residual(factor: torch.Tensor, row: torch.Tensor, col: torch.Tensor) -> float:
    norm = torch.linalg.matrix_norm(factor)
    if norm == 0:
        return 0.0
    fitted = torch.outer(row, col) * _signs(factor)
    return float(torch.linalg.matrix_norm(factor - fitted) / norm)


def low_rank_difference_norm(
    left_1: torch.Tensor, right_1: torch.Tensor, left_2: torch.Tensor, right_2: torch.Tensor
) -> float:
    """``||L1 R1 - L2 R2||_F`` without forming the products (through two small Gram matrices)."""
    left = torch.cat([left_1, -left_2], dim=1).double()
    right = torch.cat([right_1, right_2], dim=0).double()
    squared = torch.trace((left.T @ left) @ (right @ right.T))
    return math.sqrt(max(float(squared), 0.0))


def _balanced(vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rescale vectors to equal RMS, keeping their outer product: fp16 storage then neither
    underflows nor overflows on one of them."""
    rms = [v.square().mean().sqrt() for v in vectors]
    total = math.prod(float(r) for r in rms)
    if total == 0 or not math.isfinite(total):
        return vectors
    target = total ** (1.0 / len(vectors))
    return [v * (target / float(r)) for v, r in zip(vectors, rms, strict=True)]


def fit_lora(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float = 1.0,
    *,
    input_scale: bool = False,
) -> LoRDBAFit:
    """Fit LoRDBA signs and scales to the LoRA update ``scaling * lora_b @ lora_a``.

    ``lora_a: [r, K]``, ``lora_b: [N, r]`` (peft's ``lora_A.weight`` / ``lora_B.weight``).
    ``input_scale``: also fit the per-input-channel scale ``q`` (K more fp16 values).
    """
    for name, factor in (("lora_a", lora_a), ("lora_b", lora_b)):
        if factor.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(factor.shape)}")
        if not factor.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {factor.dtype}")
        if not bool(torch.isfinite(factor).all()):
            raise ValueError(f"{name} contains NaN or Inf")
    if lora_a.shape[0] != lora_b.shape[1]:
        raise ValueError(
            f"rank mismatch: lora_a is {tuple(lora_a.shape)} (rank {lora_a.shape[0]}), "
            f"lora_b is {tuple(lora_b.shape)} (rank {lora_b.shape[1]})"
        )
    a = lora_a.detach().to(device="cpu", dtype=torch.float64)
    b = lora_b.detach().to(device="cpu", dtype=torch.float64)
    a_row, a_col = _rank_one_magnitude(a, fit_cols=input_scale)
    b_row, b_col = _rank_one_magnitude(b, fit_cols=True)
    if not bool(b.any()):
        # An untrained LoRA (B = 0): p = 0 already makes the update zero; keep m nonzero so
        # gradients reach A's latent and m once training starts.
        b_col = torch.ones_like(b_col)
    vectors = [scaling * b_row, b_col * a_row] + ([a_col] if input_scale else [])
    vectors = _balanced(vectors)
    scale_out, scale_rank = vectors[0], vectors[1]
    scale_in = vectors[2] if input_scale else None

    update_norm = math.sqrt(max(float(torch.trace((b.T @ b) @ (a @ a.T))), 0.0)) * abs(scaling)
    signs_a, signs_b = _signs(a), _signs(b)
    fitted_left = scale_out[:, None] * signs_b * scale_rank[None, :]
    fitted_right = signs_a if scale_in is None else signs_a * scale_in[None, :]
    error = low_rank_difference_norm(scaling * b, a, fitted_left, fitted_right)
    rho_a = _relative_residual(a, a_row, a_col)
    rho_b = _relative_residual(b, b_row, b_col)
    if update_norm == 0:
        relative_error, bound, predicted = (0.0 if error == 0 else math.inf), 0.0, 0.0
    else:
        relative_error = error / update_norm
        norms = float(torch.linalg.matrix_norm(a) * torch.linalg.matrix_norm(b)) * abs(scaling)
        kappa = norms / update_norm
        bound = kappa * (rho_a + rho_b + rho_a * rho_b)
        rank = a.shape[0]
        predicted = kappa / math.sqrt(rank) * math.hypot(rho_a, rho_b, rho_a * rho_b)
    return LoRDBAFit(
        latent_a=lora_a.detach().float().clone(),
        latent_b=lora_b.detach().float().clone(),
        scale_in=None if scale_in is None else scale_in.float(),
        scale_rank=scale_rank.float(),
        scale_out=scale_out.float(),
        residual_ratio_a=rho_a,
        residual_ratio_b=rho_b,
        reconstruction_error=relative_error,
        error_bound=bound,
        predicted_error=predicted,
    )
