"""Helpers for tests and benchmarks of LoRDBA (used by this package's tests and
``bench/lordba.py``)."""

from __future__ import annotations

import torch
from torch import nn

from loka.lordba.module import LoRDBALinear


def kernels_runnable() -> bool:
    """Whether the sign-GEMM kernels can run here: on a GPU, or in Triton's interpreter (which
    needs TRITON_INTERPRET=1 set before ``loka.lordba.kernels`` was first imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    from loka.lordba.kernels import down

    return torch.cuda.is_available() or isinstance(down._sign_down_kernel, InterpretedFunction)


def trained_like(module: LoRDBALinear, seed: int = 0) -> LoRDBALinear:
    """Nonzero scales (``m`` over ``sqrt(K)``) and random latents, as after training: a fresh
    adapter's ``p = 0`` would hide the update."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in (module.scale_in, module.scale_rank, module.scale_out):
            if param is not None:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
        module.scale_rank.div_(module.in_features**0.5)
        module.latent_a.copy_(torch.randn(module.latent_a.shape, generator=gen))
        module.latent_b.copy_(torch.randn(module.latent_b.shape, generator=gen))
    return module


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """``actual`` equals ``expected`` within ``tol`` of ``expected``'s largest magnitude."""
    scale = expected.float().abs().max().clamp_min(1e-6)
    torch.testing.assert_close(actual.float() / scale, expected.float() / scale, atol=tol, rtol=tol)


class OpaqueBase(nn.Module):
    """A base that is not an ``nn.Linear`` (as a quantized base would be), wrapping one:
    LoRDBA runs it through its own forward and adds the update into its output."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):
        return self.linear(x)
