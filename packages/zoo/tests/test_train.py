"""The training loop."""

from __future__ import annotations

import pytest
import torch

import loka.zoo as zoo


def test_train_reports_every_step() -> None:
    setup = zoo.create("dlrm")
    seen: list[tuple[int, float]] = []
    losses = zoo.train(setup, 5, on_step=lambda step, loss: seen.append((step, loss)))
    assert len(losses) == 5 and [s for s, _ in seen] == list(range(5))
    assert [loss for _, loss in seen] == pytest.approx(losses)
    assert zoo.train(setup, 0) == []


def test_bf16_autocast_runs_the_linears_in_bf16() -> None:
    setup = zoo.create("dhen")
    dtypes: set[torch.dtype] = set()
    hook = setup.model.blocks[0].fc1.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    losses = zoo.train(setup, 3, autocast_dtype=torch.bfloat16)
    hook.remove()
    assert dtypes == {torch.bfloat16} and all(l == l for l in losses)  # noqa: E741
    with pytest.raises(ValueError, match="autocast_dtype"):
        zoo.train(setup, 1, autocast_dtype=torch.float16)


def test_given_optimizer_is_used() -> None:
    setup = zoo.create("wukong")
    optimizer = torch.optim.SGD(setup.model.parameters(), lr=0.0)
    before = {k: v.clone() for k, v in setup.model.state_dict().items()}
    zoo.train(setup, 2, optimizer=optimizer)
    assert all(torch.equal(v, setup.model.state_dict()[k]) for k, v in before.items())


def test_non_finite_loss_stops_before_any_update() -> None:
    setup = zoo.create("sasrec")
    optimizer = torch.optim.AdamW(setup.model.parameters())
    zoo.train(setup, 2, optimizer=optimizer)
    with torch.no_grad():
        setup.model.blocks[0].qkv.weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in setup.model.state_dict().items()}
    steps_before = {id(p): float(s["step"]) for p, s in optimizer.state.items()}
    with pytest.raises(FloatingPointError, match="step 0: loss is nan"):
        zoo.train(setup, 3, optimizer=optimizer)
    after = setup.model.state_dict()
    assert all(torch.equal(v.nan_to_num(), after[k].nan_to_num()) for k, v in before.items())
    assert {id(p): float(s["step"]) for p, s in optimizer.state.items()} == steps_before


def test_training_step_trains_a_compiled_or_wrapped_model() -> None:
    setup = zoo.create("hstu")
    wrapper = torch.nn.Sequential(setup.model)  # stands in for a converted model
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=1e-2)
    batch = next(setup.train_batches())
    first = zoo.training_step(setup, wrapper[0], optimizer, batch, check_finite=False)
    second = zoo.training_step(setup, wrapper[0], optimizer, batch)
    assert second < first
    with pytest.raises(ValueError, match="steps"):
        zoo.train(setup, -1)
