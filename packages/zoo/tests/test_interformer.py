"""InterFormer: both arms exchange information in every layer, the model uses the sequence,
bad sequences are refused. (Shapes, gradients, determinism and learning are checked for every
zoo model in test_models.py; the GEMM and norm contract in test_contract.py.)"""

from __future__ import annotations

import pytest
import torch

import loka.zoo as zoo


def test_information_flows_both_ways_within_one_layer() -> None:
    setup = zoo.create("interformer", batch_size=8)
    model = setup.model
    batch = next(setup.train_batches())
    dense_vector, pooled = model.inputs(batch)
    x = torch.cat([dense_vector.unsqueeze(1), pooled], 1).detach().requires_grad_()
    seq, valid = model.embed_sequence(batch["sequence"])
    seq = seq.detach().requires_grad_()
    x_out, seq_out = model.layers[0](x, seq, valid)
    # The interaction arm reads the sequence (through its summary) ...
    (grad_seq,) = torch.autograd.grad(x_out.sum(), seq, retain_graph=True)
    assert grad_seq.abs().sum() > 0
    # ... and the sequence arm reads the non-sequence features (through theirs).
    (grad_x,) = torch.autograd.grad(seq_out.sum(), x)
    assert grad_x.abs().sum() > 0
    assert x_out.shape == x.shape and seq_out.shape == seq.shape


def test_padding_neither_moves_the_prediction_nor_leaves_zero() -> None:
    setup = zoo.create("interformer", batch_size=8)
    model = setup.model.eval()
    batch = next(setup.train_batches())
    recent = batch["sequence"][:, -10:]
    padded = torch.cat([torch.zeros_like(recent[:, :6]), recent], 1)
    with torch.no_grad():
        seq, valid = model.embed_sequence(padded)
        assert (seq[~valid] == 0).all() and valid[:, : setup.config.num_cls].all()
        # More left-padding in front of the same items: the same logits.
        torch.testing.assert_close(
            model({**batch, "sequence": padded}), model({**batch, "sequence": recent})
        )


def test_the_trained_model_uses_the_sequence() -> None:
    setup = zoo.create("interformer", sequence_share=0.8)
    held_out = setup.eval_batches(2)
    zoo.train(setup, 60, lr=3e-3)
    g = torch.Generator().manual_seed(0)
    shuffled = [
        {**b, "sequence": b["sequence"][torch.randperm(b["label"].numel(), generator=g)]}
        for b in held_out
    ]
    real, other = setup.metrics(setup.model, held_out), setup.metrics(setup.model, shuffled)
    assert real["ne"] < other["ne"] - 0.01, (real, other)


def test_rejects_bad_sequences() -> None:
    setup = zoo.create("interformer", batch_size=4)
    batch = next(setup.train_batches())
    with pytest.raises(ValueError, match="sequence must be"):
        setup.model({**batch, "sequence": batch["sequence"].flatten()})
    too_long = torch.ones(4, setup.config.max_seq_len + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="max_seq_len"):
        setup.model({**batch, "sequence": too_long})
    unknown = batch["sequence"].clone()
    unknown[0, -1] = setup.config.num_items + 1
    with pytest.raises(RuntimeError, match="item id outside"):
        setup.model({**batch, "sequence": unknown})
    with pytest.raises(ValueError, match="num_recent"):
        zoo.create("interformer", num_recent=17)
    with pytest.raises(ValueError, match="divisible"):
        zoo.create("interformer", num_heads=3)


def test_math_attention_computes_what_sdpa_does_and_compiles() -> None:
    fused = zoo.create("interformer", batch_size=16, seed=3, attention="sdpa")
    plain = zoo.create("interformer", batch_size=16, seed=3, attention="math")
    assert plain.config.attention == "math" and fused.config.attention == "sdpa"
    plain.model.load_state_dict(fused.model.state_dict())
    batch = next(fused.train_batches())
    assert (batch["sequence"] == 0).any()  # padded keys are masked out in both

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        loss = model(batch).square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = loss_and_grads(fused.model)
    got, got_grads = loss_and_grads(plain.model)
    torch.testing.assert_close(got, want)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)
    compiled = torch.compile(plain.model, fullgraph=True)
    torch.testing.assert_close(compiled(batch), plain.model(batch), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="attention must be 'auto', 'sdpa' or 'math'"):
        zoo.create("interformer", attention="flash")


def test_auto_attention_is_sdpa_eagerly_and_plain_ops_when_compiled(monkeypatch) -> None:
    from loka.zoo.models import interformer

    setup = zoo.create("interformer", batch_size=8, seed=1)
    assert setup.config.attention == "auto"
    batch = next(setup.train_batches())
    fused_calls = []
    sdpa = interformer.F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        fused_calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(interformer.F, "scaled_dot_product_attention", counting_sdpa)
    eager = setup.model(batch)
    assert fused_calls, "eagerly, auto attention runs SDPA"

    graph_targets: list[str] = []

    def recording_backend(gm, example_inputs):
        graph_targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(setup.model, backend=recording_backend, fullgraph=True)
    torch.testing.assert_close(compiled(batch), eager, rtol=1e-4, atol=1e-5)
    assert graph_targets and not any("scaled_dot_product" in t for t in graph_targets)
    assert any("softmax" in t for t in graph_targets)
