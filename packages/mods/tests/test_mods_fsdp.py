"""Fp8Linear under FSDP2 (`fully_shard`): converted before or after sharding, a sharded model
trains exactly as the unsharded one (two gloo processes on the CPU), and the class swap that
converts a managed linear in place (`loka.mods.sharding`) is undone exactly."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel backend runs in the interpreter

import textwrap

import pytest
import torch
from torch import nn

from loka.mods import Fp8Linear, Fp8LinearConfig, ModsError, ModSpec, SiteMods, apply
from loka.mods.fp8_linear import convert_to_fp8_linear, convert_to_linear
from loka.mods.sharding import base_class, fsdp_managed, swap_base_class

ROW = "e4m3:e4m3/row/dynamic"


class _Mixin:
    """Stands in for FSDP's FSDPModule: what `loka.mods.sharding` reads of it."""

    _orig_cls_mro_index = 2


def _wrapped(module: nn.Module) -> nn.Module:
    """`module` with its class swapped as fully_shard swaps it (``FSDP<Class>``)."""
    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (_Mixin, cls), {})
    return module


def test_in_place_conversion_keeps_the_object_and_the_wrapper_and_undoes_exactly() -> None:
    torch.manual_seed(0)
    linear = _wrapped(nn.Linear(32, 16))
    wrapper_class = type(linear)
    weight, bias = linear.weight, linear.bias
    state = set(vars(linear))
    assert base_class(linear) is nn.Linear and fsdp_managed(linear)
    config = Fp8LinearConfig.from_recipes(ROW, ROW, "bf16", backend="torch.native.cpu")
    converted = Fp8Linear.in_place(linear, config)
    assert converted is linear and isinstance(linear, Fp8Linear) and isinstance(linear, _Mixin)
    assert base_class(linear) is Fp8Linear and type(linear).__name__ == "FSDPFp8Linear"
    assert linear.weight is weight and linear.bias is bias
    x = torch.randn(8, 32)
    reference = Fp8Linear.from_linear(nn.Linear(32, 16), config)
    reference.load_state_dict(linear.state_dict())
    torch.testing.assert_close(linear(x), reference(x), rtol=0, atol=0)
    assert linear.to_linear() is linear
    assert type(linear) is wrapper_class and set(vars(linear)) == state
    assert set(linear.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(linear(x), nn.functional.linear(x, weight, bias))


def test_a_refused_in_place_conversion_leaves_the_class_alone() -> None:
    linear = _wrapped(nn.Linear(30, 16))
    cls = type(linear)
    bad = Fp8LinearConfig.from_recipes(ROW, ROW, ROW, backend="torch.native").replace(pad=True)
    with pytest.raises(ValueError, match="does not pad"):
        Fp8Linear.in_place(linear, bad)
    assert type(linear) is cls and not hasattr(linear, "fp8_config")
    with pytest.raises(TypeError, match=r"needs an nn\.Linear"):
        Fp8Linear.in_place(_wrapped(nn.Conv1d(2, 2, 1)))


def test_swap_base_class_reuses_one_class_per_wrapper_and_base() -> None:
    a, b = _wrapped(nn.Linear(4, 4)), nn.Linear(4, 4)
    b.__class__ = type(a)
    swap_base_class(a, Fp8Linear)
    swap_base_class(b, Fp8Linear)
    assert type(a) is type(b)
    plain = nn.Linear(4, 4)
    assert swap_base_class(plain, Fp8Linear) is nn.Linear and type(plain) is Fp8Linear
    assert not fsdp_managed(nn.Linear(4, 4))


def test_mods_that_replace_modules_are_refused_for_a_managed_linear() -> None:
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 16))
    _wrapped(model[1])
    spec = ModSpec(sites={"1": SiteMods(fp8=Fp8LinearConfig(), fuse_norm=True)})
    with pytest.raises(ModsError, match="FSDP"):
        apply(model, spec, torch.randn(4, 32))
    assert type(model[1]).__name__ == "FSDPLinear"  # unchanged


WORKER = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from loka.mods import Fp8LinearConfig, ModSpec, SiteMods, apply
    from loka.mods.fp8_linear import convert_to_fp8_linear, convert_to_linear

    ROW = "e4m3:e4m3/row/dynamic"
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def train(m, steps):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            loss = m(torch.randn(32, 32, generator=g)).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        return losses

    out = {"rank": rank}
    for backend, wgrad in (("torch.native.cpu", "bf16"), ("triton.fp8", ROW)):
        config = Fp8LinearConfig.from_recipes(ROW, ROW, wgrad, backend=backend)
        for order in ("convert-then-shard", "shard-root", "shard-per-layer", "mods-apply"):
            m = model()
            if order == "convert-then-shard":
                m = convert_to_fp8_linear(m, config)
            if order == "shard-per-layer":
                for layer in (m[0], m[2]):
                    fully_shard(layer)
            fully_shard(m)
            if order in ("shard-root", "shard-per-layer"):
                m = convert_to_fp8_linear(m, config)
            report = None
            if order == "mods-apply":
                spec = ModSpec(sites={"0": SiteMods(fp8=config), "2": SiteMods(fp8=config)})
                report = apply(m, spec, torch.randn(4, 32))
            types = [type(layer).__name__ for layer in m]
            losses = train(m, 3)
            if report is not None:
                report.undo()
            else:
                convert_to_linear(m)
            losses += train(m, 1)  # bf16 again, after the undo
            state = {k: v.full_tensor().tolist() for k, v in m.state_dict().items()}
            out[f"{backend}/{order}"] = {"types": types, "losses": losses, "state": state,
                                         "after": [type(layer).__name__ for layer in m]}
    # Compiled (each FP8 linear its own graph between FSDP's hooks, where dynamo breaks for
    # nn.Linear alike), all three passes FP8: as the compiled unsharded model, bit for bit.
    config = Fp8LinearConfig.from_recipes(ROW, ROW, ROW, backend="torch.native.cpu")
    m = model()
    for layer in (m[0], m[2]):
        fully_shard(layer)
    fully_shard(m)
    m = convert_to_fp8_linear(m, config)
    compiled = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    from torch._dynamo.utils import counters
    for step in range(3):
        loss = compiled(torch.randn(32, 32, generator=g)).square().mean()
        loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.item())
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    out["compiled"] = losses
    out["graphs_at_step_1"] = graphs
    out["graphs_after_step_1"] = counters["stats"]["unique_graphs"] - graphs
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads now and then trip on interpreter finalization
    """
)


def _fp8_model(config: Fp8LinearConfig) -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8_linear(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)), config
    )


def _train(model: nn.Module, steps: int, forward: nn.Module | None = None) -> list[float]:
    """The workers' `train` in this process (`forward`: a compiled `model`)."""
    forward = forward or model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = forward(torch.randn(32, 32, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _unsharded(config: Fp8LinearConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training in one process, unsharded: what every sharded order must equal."""
    m = _fp8_model(config)
    losses = _train(m, 3)
    m = convert_to_linear(m)
    return losses + _train(m, 1), m.state_dict()


def _compiled_unsharded_losses() -> list[float]:
    m = _fp8_model(Fp8LinearConfig.from_recipes(ROW, ROW, ROW, backend="torch.native.cpu"))
    return _train(m, 3, torch.compile(m))


def test_fp8_linears_train_under_fsdp2_as_unsharded_in_every_order(two_gloo_ranks) -> None:
    results = two_gloo_ranks(WORKER)
    assert results[0]["compiled"] == _compiled_unsharded_losses()
    assert results[0]["graphs_at_step_1"] >= 2  # a graph per linear at least
    assert results[0]["graphs_after_step_1"] == 0  # nothing compiled after the first step
    r0 = next(r for r in results if r["rank"] == 0)
    for backend, wgrad in (("torch.native.cpu", "bf16"), ("triton.fp8", ROW)):
        losses, state = _unsharded(Fp8LinearConfig.from_recipes(ROW, ROW, wgrad, backend=backend))
        for order in ("convert-then-shard", "shard-root", "shard-per-layer", "mods-apply"):
            got = r0[f"{backend}/{order}"]
            fp8_type = "FSDPFp8Linear" if order == "shard-per-layer" else "Fp8Linear"
            assert got["types"] == [fp8_type, "ReLU", fp8_type], (backend, order)
            # Gradients are averaged over two ranks that saw the same batch: the same bits.
            assert got["losses"] == losses, (backend, order)
            for name, value in state.items():
                assert torch.equal(torch.tensor(got["state"][name]), value), (backend, order, name)
            if order != "convert-then-shard":
                assert "Fp8Linear" not in "".join(got["after"]), (backend, order)
