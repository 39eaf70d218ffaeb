"""The contract other packages code against: GEMMs are nn.Linear, norms sit right before
the Linear they feed, `create` validates its arguments, large presets fit one H200."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import loka.zoo as zoo
from loka.zoo.models import SequentialConfig
from loka.zoo.registry import SPECS

NORMS = (nn.LayerNorm, nn.RMSNorm)
GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class _CountGemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in GEMMS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", zoo.MODELS)
def test_every_2d_gemm_is_an_nn_linear(name: str) -> None:
    setup = zoo.create(name)
    model = setup.model
    batch = next(setup.train_batches())
    calls = []
    hooks = [
        m.register_forward_hook(lambda *_: calls.append(1))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    # Sequential models score against item embeddings outside any Linear (documented);
    # everything up to the hidden states must go through Linears.
    run = model.encode if name in ("hstu", "sasrec") else model
    with torch.no_grad(), _CountGemms() as gemms:
        run(batch)
    for hook in hooks:
        hook.remove()
    assert gemms.count == len(calls) > 0


@pytest.mark.parametrize("name", zoo.MODELS)
def test_a_norm_followed_by_a_linear_of_its_width_feeds_it(name: str) -> None:
    """Mods fuses a norm with the Linear that follows it in module order: wherever the
    widths allow it, the Linear must really consume the norm's output."""
    setup = zoo.create(name)
    modules = list(setup.model.named_modules())
    pairs = [
        (norm_name, linear_name)
        for (norm_name, norm), (linear_name, linear) in itertools.pairwise(modules)
        if isinstance(norm, NORMS)
        and isinstance(linear, nn.Linear)
        and norm.normalized_shape[-1] == linear.in_features
    ]
    layers = getattr(setup.config, "num_layers", 0)
    # InterFormer, per layer: PMA, interaction MLP, personalized FFN, attention; then the
    # final summary's PMA and the head.
    expected = {
        "dlrm": 0,
        "dhen": layers + 1,
        "wukong": layers,
        "hstu": 2 * layers,
        "interformer": 4 * layers + 2,
    }
    assert len(pairs) == expected.get(name, 2 * layers), pairs
    outputs: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    named = dict(modules)
    hooks = []
    for norm_name, linear_name in pairs:
        hooks.append(named[norm_name].register_forward_hook(
            lambda _m, _i, out, n=norm_name: outputs.__setitem__(n, out)))  # fmt: skip
        hooks.append(named[linear_name].register_forward_hook(
            lambda _m, inp, _o, n=linear_name: inputs.__setitem__(n, inp[0])))  # fmt: skip
    with torch.no_grad():
        setup.model(next(setup.train_batches()))
    for hook in hooks:
        hook.remove()
    for norm_name, linear_name in pairs:
        assert inputs[linear_name] is outputs[norm_name], f"{norm_name} does not feed {linear_name}"


@pytest.mark.parametrize("name", zoo.MODELS)
def test_large_preset_fits_one_h200(name: str) -> None:
    """Built on the meta device: parameters, AdamW state and gradients of the large presets
    take a fraction of an H200's 141 GB, and their widths are in the 1k-4k range."""
    spec = SPECS[name]
    model_kwargs, _, batch = spec.presets["large"]
    config = spec.config(**model_kwargs)
    with torch.device("meta"):
        model = spec.model(config)
    params = sum(p.numel() for p in model.parameters())
    assert params * 4 * 4 < 30e9  # fp32 weights, gradients, two AdamW moments
    widest = max(m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    assert 1024 <= widest <= 4096
    sequential = isinstance(config, SequentialConfig)  # a batch of sequences, else of samples
    tokens = batch * (config.max_seq_len if sequential else 1)
    assert 16384 <= tokens <= 65536


def test_create_names_its_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown model 'bert'"):
        zoo.create("bert")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        zoo.create("dlrm", "huge")
    with pytest.raises(TypeError, match=r"unknown override\(s\) \['widht'\]"):
        zoo.create("dhen", widht=64)
    with pytest.raises(ValueError, match="batch_size"):
        zoo.create("dlrm", batch_size=0)
    with pytest.raises(ValueError, match="embedding_dim"):
        zoo.create("dlrm", embedding_dim=-1)
    with pytest.raises(ValueError, match="divisible"):
        zoo.create("sasrec", embedding_dim=30, num_heads=4)
    with pytest.raises(ValueError, match="num_sparse and max_table_rows"):
        zoo.create("dlrm", cardinalities=(10, 10))
    with pytest.raises(ValueError, match="dataset must be"):
        zoo.create("sasrec", dataset="books")
    with pytest.raises(ValueError, match="layout"):
        zoo.create("hstu", layout="ragged")
    with pytest.raises(ValueError, match="uniformly"):
        zoo.create("hstu", negative_sampling="popularity")


def test_create_applies_overrides_to_model_and_data() -> None:
    setup = zoo.create("dhen", batch_size=8, num_sparse=5, width=48, max_bag_size=1)
    assert setup.config.num_sparse == 5 and setup.config.width == 48
    assert setup.data_config.max_bag_size == 1
    batch = next(setup.train_batches())
    assert batch["sparse"].shape == (8, 5, 1) and batch["dense"].shape == (8, 13)
    hstu = zoo.create("hstu", layout="padded", num_items=64)
    assert hstu.data_config.layout == "padded" and "offsets" not in next(hstu.train_batches())
    assert int(next(hstu.train_batches())["items"].max()) <= 64


def test_setup_exposes_the_contract() -> None:
    setup = zoo.create("wukong", seed=2)
    assert (setup.name, setup.preset, setup.seed) == ("wukong", "tiny", 2)
    assert dataclasses.is_dataclass(setup.config)
    assert setup.model.training and next(setup.model.parameters()).device.type == "cpu"
    held_out = setup.eval_batches(3)
    assert len(held_out) == 3 and set(held_out[0]) == {"dense", "sparse", "label"}
    assert set(setup.metrics(setup.model, held_out)) == {"logloss", "ne", "auc"}
    assert setup.model.training, "metrics must restore training mode"
    # Held-out batches belong to the dataset, not to the training seed.
    other = zoo.create("wukong", seed=5)
    assert torch.equal(other.eval_batches(1)[0]["sparse"], held_out[0]["sparse"])
    test_split = setup.eval_batches(1, split="test")[0]
    assert not torch.equal(test_split["sparse"], held_out[0]["sparse"])
    sequential = zoo.create("sasrec")
    assert set(sequential.metrics(sequential.model, sequential.eval_batches(1))) == {
        "hr@10", "ndcg@10", "mrr"
    }  # fmt: skip
    with pytest.raises(ValueError, match="not a sequential"):
        setup.popularity_baseline()
