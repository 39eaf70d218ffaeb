"""Every model in its tiny preset: forward/backward, determinism per seed, learning."""

from __future__ import annotations

import pytest
import torch

import loka.zoo as zoo

CTR = ("dlrm", "dhen", "wukong", "interformer")
SEQUENTIAL = ("hstu", "sasrec")


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", zoo.MODELS)
def test_forward_backward_reaches_every_parameter(name: str) -> None:
    setup = zoo.create(name)
    batch = next(setup.train_batches())
    out = setup.model(batch)
    if name in CTR:
        assert out.shape == (setup.batch_size,)
    else:
        assert out.shape == (*batch["targets"].shape, 1 + batch["negatives"].numel())
    loss = setup.loss(setup.model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, param in setup.model.named_parameters():
        assert param.grad is not None, f"{pname} gets no gradient"
        assert torch.isfinite(param.grad).all(), f"{pname} has a non-finite gradient"
        assert param.grad.abs().sum() > 0, f"{pname} has an all-zero gradient"


@pytest.mark.parametrize("name", zoo.MODELS)
def test_deterministic_per_seed(name: str) -> None:
    first, again, other = (
        zoo.create(name, seed=3),
        zoo.create(name, seed=3),
        zoo.create(name, seed=4),
    )
    for key, value in _params(first.model).items():
        assert torch.equal(value, _params(again.model)[key]), key
    assert any(
        not torch.equal(value, _params(other.model)[key])
        for key, value in _params(first.model).items()
        if value.is_floating_point() and value.numel() > 1 and value.abs().sum() > 0
    )
    batch, batch_again = next(first.train_batches()), next(again.train_batches())
    assert all(torch.equal(batch[k], batch_again[k]) for k in batch)
    batch_other = next(other.train_batches())
    assert any(
        batch[k].shape != batch_other[k].shape or not torch.equal(batch[k], batch_other[k])
        for k in batch
    )
    assert zoo.train(first, 3) == zoo.train(again, 3)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_learns_in_a_few_dozen_steps(name: str) -> None:
    setup = zoo.create(name)
    held_out = setup.eval_batches(2)
    before = setup.metrics(setup.model, held_out)
    losses = zoo.train(setup, 48, lr=3e-3)
    after = setup.metrics(setup.model, held_out)
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.985 * first, f"loss {first:.4f} -> {last:.4f}"
    if name in CTR:
        assert after["ne"] < before["ne"] - 0.05
    else:
        assert after["mrr"] > before["mrr"] + 0.03


@pytest.mark.parametrize("name", SEQUENTIAL)
def test_sequential_models_beat_popularity_on_synthetic_data(name: str) -> None:
    setup = zoo.create(name)
    held_out = setup.eval_batches(8)
    zoo.train(setup, 300, lr=3e-3)
    model = setup.metrics(setup.model, held_out)
    popular = setup.metrics(setup.popularity_baseline(), held_out)
    assert model["hr@10"] > popular["hr@10"] + 0.03, (model, popular)
    assert model["ndcg@10"] > popular["ndcg@10"] + 0.03, (model, popular)


def test_hstu_jagged_and_padded_batches_agree() -> None:
    padded = zoo.create("hstu", layout="padded")
    jagged = zoo.create("hstu", layout="jagged")
    jagged.model.load_state_dict(padded.model.state_dict())
    batch_p, batch_j = next(padded.train_batches()), next(jagged.train_batches())
    real = batch_p["items"] != 0
    assert torch.equal(batch_p["items"][real], batch_j["items"])
    hidden_p = padded.model.encode(batch_p)
    hidden_j = jagged.model.encode(batch_j)
    torch.testing.assert_close(hidden_p[real], hidden_j, rtol=1e-5, atol=1e-5)
    # The losses average over the same (input, target) pairs.
    torch.testing.assert_close(
        padded.loss(padded.model, batch_p), jagged.loss(jagged.model, batch_j), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("name", SEQUENTIAL)
def test_user_embedding_is_the_final_state_of_the_history(name: str) -> None:
    setup = zoo.create(name, layout="padded")
    history = setup.eval_batches(1)[0]["items"]
    model = setup.model.eval()
    with torch.no_grad():
        users = model.user_embedding(history)
        assert users.shape == (history.size(0), setup.config.embedding_dim)
        torch.testing.assert_close(users, model.encode({"items": history})[:, -1])
        # A shorter window of the same history changes nothing but what it drops.
        longer = torch.cat([torch.zeros_like(history[:, :4]), history], dim=1)
        torch.testing.assert_close(model.user_embedding(longer), users)
    right_padded = history.clone()
    right_padded[0] = torch.roll(history[0], 1)
    right_padded[0, -1] = 0
    with pytest.raises(ValueError, match="left-padded"):
        model.user_embedding(right_padded)


def test_sasrec_rejects_jagged_batches() -> None:
    setup = zoo.create("sasrec", layout="jagged")
    with pytest.raises(ValueError, match="padded"):
        setup.model(next(setup.train_batches()))


@pytest.mark.parametrize("name", CTR)
def test_ctr_models_reject_bad_inputs(name: str) -> None:
    setup = zoo.create(name)
    batch = next(setup.train_batches())
    with pytest.raises(ValueError, match="dense features"):
        setup.model({**batch, "dense": batch["dense"][:, :5]})
    with pytest.raises(ValueError, match="sparse ids"):
        setup.model({**batch, "sparse": batch["sparse"].float()})
    too_large = batch["sparse"].clone()
    too_large[0, 0, 0] = setup.config.cardinalities[0]
    with pytest.raises(RuntimeError, match="outside"):
        setup.model({**batch, "sparse": too_large})


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_rmsnorm_variant_builds_and_trains(norm: str) -> None:
    setup = zoo.create("dhen", norm=norm)
    kinds = {type(m) for m in setup.model.modules()}
    assert (zoo.RMSNorm in kinds) == (norm == "rmsnorm")
    assert torch.isfinite(torch.tensor(zoo.train(setup, 2))).all()


def test_wukong_mixings_compute_the_same_function() -> None:
    linear = zoo.create("wukong", seed=5)
    bmm = zoo.create("wukong", seed=5, mixing="bmm")
    state = {k.replace(".compress.weight", ".compress_weight"): v
             for k, v in linear.model.state_dict().items()}  # fmt: skip
    assert state.keys() == bmm.model.state_dict().keys()  # the same weights, held by the blocks
    for key, value in bmm.model.state_dict().items():  # and initialized alike
        assert torch.equal(state[key], value), key
    batch = next(linear.train_batches())
    for autocast in (False, True):
        losses, grads = [], []
        for setup in (linear, bmm):
            setup.model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = setup.loss(setup.model, batch)
            loss.backward()
            losses.append(loss.detach())
            grads.append({
                k.replace(".compress.weight", ".compress_weight"): p.grad.float()
                for k, p in setup.model.named_parameters()
            })  # fmt: skip
        tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses[0], losses[1], **tol)
        for name, grad in grads[0].items():
            cos = torch.nn.functional.cosine_similarity(grad.flatten(), grads[1][name].flatten(), 0)
            assert cos > (0.99 if autocast else 0.99999), (name, autocast, float(cos))
    with pytest.raises(ValueError, match="mixing"):
        zoo.create("wukong", mixing="einsum")
    # No nn.Linear mixes the embeddings any more: nothing for Probe to hook there.
    linears = [n for n, m in bmm.model.named_modules() if type(m) is torch.nn.Linear]
    assert not any(n.endswith("compress") for n in linears) and any("fmb.mlp" in n for n in linears)


def test_wukong_bmm_mixing_traces_without_strided_copies() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from loka.zoo.models.wukong import WukongConfig, WukongLayer

    x = torch.randn(4, 6, 8)

    def graph(mixing: str):
        config = WukongConfig(num_sparse=5, max_table_rows=10, embedding_dim=8, fm_outputs=3,
                              lcb_outputs=3, fm_rank=2, fm_hidden=16, mixing=mixing)  # fmt: skip
        layer = WukongLayer(config, num_inputs=6)

        def forward_backward(x):
            y = layer(x)
            return y, torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])

        return make_fx(forward_backward)(x.clone().requires_grad_()).graph

    def strided(g) -> list[str]:
        """Copies of activations, and transposed activations (3-d) that reach anything but a
        bmm (which reads a transposed operand as it is), directly or through transposes:
        what makes the norms read strided. 2-d weight transposes are the GEMMs' own."""

        def reaches_only_bmm(n) -> bool:
            return all(
                "bmm" in str(u.target) or ("transpose" in str(u.target) and reaches_only_bmm(u))
                for u in n.users
            )

        return [
            str(n.target) for n in g.nodes
            if "clone" in str(n.target) or "contiguous" in str(n.target)
            or ("transpose" in str(n.target) and not reaches_only_bmm(n))
        ]  # fmt: skip

    assert strided(graph("linear"))
    bmm = graph("bmm")
    assert any("bmm" in str(n.target) for n in bmm.nodes) and not strided(bmm), strided(bmm)


@pytest.mark.parametrize(
    ("name", "options"),
    [(n, {}) for n in zoo.MODELS] + [("wukong", {"mixing": "bmm"})],
)
def test_training_step_compiles_as_one_graph_under_autocast(name: str, options: dict) -> None:
    # Users train these under torch.compile with autocast: a graph break splits the step
    # (Wukong's bmm mixing once asked torch.amp.is_autocast_available, which dynamo cannot
    # trace: 11 graphs and a 22% slower compiled step on the H200).
    setup = zoo.create(name, **options)
    batch = next(setup.train_batches())
    torch._dynamo.reset()
    loss_fn = torch.compile(setup.loss, fullgraph=True, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(setup.model, batch)
    loss.backward()
    assert torch.isfinite(loss)
