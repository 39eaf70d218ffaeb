"""LoRDBALinear under torch.compile (on the CPU; the Triton backend compiles as its torch
references, see `loka.lordba.function.select_ops`): training and
inference trace whole (`fullgraph=True`) while the token count varies, over a plain and an
`Fp8WeightOnlyLinear` base, and compute what the eager module computes, gradients included.
Two failures these tests caught: the packed signs' cache kept a traced tensor, which leaked
one graph's symbols into the next trace ("Could not guard on data-dependent expression" on
the second token count), and the reference up-projection ended in a no-op `.to`, which
under torch 2.11's compile zeroes every gradient of an autograd.Function silently (the
failure `loka.mods.dtypes.cast` avoids)."""

import pytest
import torch
from torch import nn

from loka.lordba import Fp8WeightOnlyLinear, LoRDBAConfig, LoRDBALinear
from loka.lordba.testing import assert_close_scaled, trained_like

BASES = {"plain": lambda linear: linear, "fp8": Fp8WeightOnlyLinear.from_linear}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: the module's code objects are shared, and the tests
    together pass Dynamo's recompile limit (8 per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair(
    kind: str, input_scale: bool, train: bool, backend: str = "torch"
) -> tuple[LoRDBALinear, LoRDBALinear]:
    """Two identical modules: one to compile, one to run eagerly."""
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        base = BASES[kind](nn.Linear(40, 24).requires_grad_(False))
        config = LoRDBAConfig(rank=4, scaling=0.5, backend=backend, input_scale=input_scale)
        made.append(trained_like(LoRDBALinear(base, config), 0).requires_grad_(train))
    return made[0], made[1]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", list(BASES))
@pytest.mark.parametrize("train", [False, True])
def test_compiled_lordba_matches_eager_with_a_varying_token_count(kind, train, backend):
    """With ``backend="triton"`` the eager module runs the (interpreted) sign-GEMM kernels and
    the compiled one their references: Dynamo traced the kernels themselves and failed (in
    the interpreter; on the H200 inductor's recompile of them failed)."""
    compiled_module, eager = _pair(kind, input_scale=kind == "plain", train=train, backend=backend)
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True, dynamic=True)
    for tokens in (9, 12, 16):
        x = torch.randn(2, tokens, 40, generator=torch.Generator().manual_seed(tokens))
        with torch.set_grad_enabled(train):
            got, want = compiled(x), eager(x)
            assert_close_scaled(got, want, 1e-5)
            if train:
                got.square().sum().backward()
                want.square().sum().backward()
    if train:
        for p, q in zip(compiled_module.parameters(), eager.parameters(), strict=True):
            assert p.grad is not None and p.grad.abs().sum() > 0
            assert_close_scaled(p.grad, q.grad, 1e-5)


def test_compiled_lordba_trains_under_autocast():
    """The zero-gradient failure of torch 2.11 (an autograd.Function whose output is a no-op
    `.to`) showed under autocast in loka-mods; here it showed in float32 too. Under bf16
    autocast the gradients must still match eager's."""
    compiled_module, eager = _pair("plain", input_scale=True, train=True)
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True, dynamic=True)
    for tokens in (9, 12):
        x = torch.randn(2, tokens, 40, generator=torch.Generator().manual_seed(tokens))
        for module in (compiled, eager):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                module(x).float().square().sum().backward()
    for p, q in zip(compiled_module.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and p.grad.abs().sum() > 0
        assert_close_scaled(p.grad, q.grad, 2e-2)
