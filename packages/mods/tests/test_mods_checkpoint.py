"""FP8 linears under activation checkpointing (`torch.utils.checkpoint`, non-reentrant): the
rerun of the forward in the backward quantizes as the first run did, so a checkpointed model
trains bit for bit as the same model without checkpointing, delayed scaling included."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel backend runs in the interpreter

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loka.mods import Fp8LinearConfig, checkpointing
from loka.mods.fp8_linear import convert_to_fp8_linear

DELAYED = "e4m3:e4m3/tensor/delayed2"  # the history fills on step 2: reruns differ from step 3
ROW = "e4m3:e4m3/row/dynamic"


class Shared(nn.Module):
    """One linear called twice in a forward (a shared layer): two reruns per backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(32, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def _train(layout: str, recipe: str, backend: str, checkpointed: bool, micro: int = 1):
    torch.manual_seed(0)
    model = (
        Shared()
        if layout == "shared"
        else nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    )
    model = convert_to_fp8_linear(
        model, Fp8LinearConfig.from_recipes(recipe, recipe, recipe, backend=backend)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        for _ in range(micro):  # gradient accumulation: a backward per micro-batch
            x = torch.randn(16, 32, generator=g, requires_grad=True)
            y = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
            loss = y.square().mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, model.state_dict()


@pytest.mark.parametrize(
    ("layout", "recipe", "backend", "micro"),
    [
        ("mlp", DELAYED, "triton.fp8", 1),
        ("shared", DELAYED, "triton.fp8", 1),
        ("mlp", DELAYED, "triton.fp8", 2),
        ("mlp", ROW, "torch.native.cpu", 1),
    ],
)
def test_a_checkpointed_fp8_model_trains_bit_for_bit_as_without(layout, recipe, backend, micro):
    losses, state = _train(layout, recipe, backend, False, micro)
    ck_losses, ck_state = _train(layout, recipe, backend, True, micro)
    assert ck_losses == losses
    assert state.keys() == ck_state.keys()
    for name, value in state.items():  # weights and amax histories alike
        assert torch.equal(ck_state[name], value), name
    assert not checkpointing._KEPT  # each region's kept histories went with the region
    if "delayed" in recipe:
        assert any("amax_history_input" in name for name in state)


def test_other_saved_tensor_hooks_leave_the_forward_alone() -> None:
    """Hooks that are not checkpointing's (a callable object, a builtin) are not a region."""

    class Keep:
        def __call__(self, t):
            return t

    assert checkpointing.region() == (None, False)
    with torch.autograd.graph.saved_tensors_hooks(Keep(), Keep()):
        assert checkpointing.region() == (None, False)
    with torch.autograd.graph.saved_tensors_hooks(torch.clone, torch.clone):
        assert checkpointing.region() == (None, False)
    with torch.autograd.graph.save_on_cpu():
        assert checkpointing.region() == (None, False)
        model = convert_to_fp8_linear(
            nn.Linear(32, 16),
            Fp8LinearConfig.from_recipes(DELAYED, DELAYED, DELAYED, backend="triton.fp8"),
        )
        model(torch.randn(8, 32, requires_grad=True)).sum().backward()


FSDP_WORKER = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, sys.argv[2])
    from test_mods_checkpoint import DELAYED, Blocks, train_blocks

    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def shard(model):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    print(json.dumps({"losses": train_blocks(checkpointed=True, prepare=shard)}), flush=True)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)
    """
)


class Blocks(nn.Module):
    """Two residual MLP blocks, each its own checkpoint region (and FSDP unit)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)
        )
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x))
        return x


def train_blocks(checkpointed: bool, prepare=None) -> list[float]:
    torch.manual_seed(0)
    config = Fp8LinearConfig.from_recipes(DELAYED, DELAYED, DELAYED, backend="triton.fp8")
    model = convert_to_fp8_linear(Blocks(checkpointed), config)
    if prepare is not None:
        prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        loss = model(torch.randn(16, 32, generator=g, requires_grad=True)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fsdp2_with_checkpointing_trains_as_neither(two_gloo_ranks) -> None:
    """FSDP2 gathers a block's weights anew for the rerun: the rerun keeps the weight's FP8
    copy its first run made instead of re-making it (which recorded the weight's amax twice
    a step: delayed scaling drifted from step 3)."""
    source = FSDP_WORKER.replace("sys.argv[2]", repr(str(Path(__file__).parent)))
    results = two_gloo_ranks(source)
    assert results[0]["losses"] == results[1]["losses"] == train_blocks(checkpointed=False)
