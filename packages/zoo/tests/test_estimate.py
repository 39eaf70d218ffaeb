"""The step estimate (meta device only) and the xl presets it sizes: linears dominate the
step, the step fits one H200 with FP8 copies of the weights, tables update row-wise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loka.zoo as zoo
from loka.zoo.estimate import H200, estimate_step
from loka.zoo.optim import DENSE_EMBEDDINGS, SPARSE_EMBEDDINGS
from loka.zoo.registry import SPECS, preset_config

XL = ("dhen", "wukong", "interformer", "hstu")


def _linear_flops_of_a_real_step(name: str, batch_size: int) -> int:
    """Forward, dgrad (when the input needs a gradient) and wgrad of every Linear call,
    counted on a real CPU step of the tiny preset."""
    setup = zoo.create(name, batch_size=batch_size)
    flops = []

    def hook(module: nn.Linear, inputs: tuple, output: torch.Tensor) -> None:
        (x,) = inputs
        passes = 1 + x.requires_grad + module.weight.requires_grad
        flops.append(2 * x.numel() * module.out_features * passes)

    hooks = [
        m.register_forward_hook(hook) for m in setup.model.modules() if isinstance(m, nn.Linear)
    ]
    setup.loss(setup.model, next(setup.train_batches())).backward()
    for h in hooks:
        h.remove()
    return sum(flops)


def _vectors_and_dim(name: str) -> tuple[int, int]:
    config, _, _ = preset_config(name, "tiny")
    return config.num_sparse + 1, config.embedding_dim


@pytest.mark.parametrize("name", ["dlrm", "interformer"])
def test_gemms_are_attributed_to_linears_exactly(name: str) -> None:
    estimate = estimate_step(name, "tiny", batch_size=8)
    assert estimate.linear_flops == _linear_flops_of_a_real_step(name, 8)
    if name == "dlrm":
        # The dot interaction's bmm, forward and its two backward GEMMs; nothing else.
        vectors, dim = _vectors_and_dim("dlrm")
        assert estimate.other_matmul_flops == 3 * 2 * 8 * vectors * vectors * dim
    assert 0 < estimate.other_flops < estimate.linear_flops


def test_memory_adds_up_and_the_sparse_path_holds_less_state() -> None:
    dense = estimate_step("dhen", "tiny")
    sparse = estimate_step("dhen", "tiny", sparse_embeddings=True)
    assert (dense.embedding_update, sparse.embedding_update) == (
        DENSE_EMBEDDINGS,
        SPARSE_EMBEDDINGS,
    )
    assert dense.state_bytes == 16 * (dense.dense_params + dense.embedding_params)
    assert sparse.state_bytes == 16 * sparse.dense_params + 4 * (
        sparse.embedding_params + sparse.embedding_rows
    )
    assert sparse.embedding_seconds < dense.embedding_seconds
    assert dense.fp8_bytes == 2 * dense.linear_params
    assert dense.activation_bytes > 2 * dense.linear_params  # saved activations on top
    assert dense.memory_bytes == (
        dense.state_bytes + dense.fp8_bytes + dense.activation_bytes + dense.transient_bytes
    )


@pytest.mark.parametrize("name", XL)
def test_xl_presets_are_linear_dominated_and_fit_one_h200(name: str) -> None:
    estimate = estimate_step(name, "xl")
    summary = estimate.summary()
    assert estimate.embedding_update == SPARSE_EMBEDDINGS, "xl trains tables row-wise"
    assert estimate.linear_flop_share > 0.9, summary
    # The roofline's compiled step, and the unfused (eager) one: a lower bound.
    assert estimate.linear_time_share > 0.55, summary
    assert estimate.linear_time_share_unfused > 0.45, summary
    # Weights, gradients, optimizer state, FP8 copies and activations in 80% of the HBM.
    assert estimate.fits and estimate.memory_bytes < 0.8 * H200.memory, summary
    config, _, batch = preset_config(name, "xl")
    tokens = batch * (config.max_seq_len if name == "hstu" else 1)
    assert tokens >= 16384
    with torch.device("meta"):
        model = SPECS[name].model(config)
    widest = max(
        min(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)
    )
    assert 1024 <= widest <= 4096


def test_xl_is_offered_for_the_production_models_only() -> None:
    assert {name for name, spec in SPECS.items() if "xl" in spec.presets} == set(XL)
    with pytest.raises(ValueError, match="dlrm has no 'xl' preset"):
        zoo.create("dlrm", "xl")
    # The dense path stays available for xl.
    config, _, _ = preset_config("dhen", "xl", sparse_embeddings=False)
    assert not config.sparse_embeddings


@pytest.mark.parametrize("name", zoo.MODELS)
def test_every_model_can_be_estimated(name: str) -> None:
    estimate = estimate_step(name, "tiny")
    assert estimate.linear_flops > 0 and estimate.step_seconds > 0
    assert 0 < estimate.linear_time_share_unfused <= estimate.linear_time_share < 1
    with pytest.raises(ValueError, match="use create"):
        preset_config("sasrec", dataset="beauty")
