"""The REPREC injector: shapes, normalization, soft-token masks and labels, frozen-backbone
gradients, parameter share, and clear errors for bad input."""

import pytest
import torch
from torch import nn

from loka.reprec.injector import (
    IGNORE_INDEX,
    InjectorConfig,
    UserEmbeddingInjector,
    check_backbone,
    parameter_share,
    prepend_soft_tokens,
)

transformers = pytest.importorskip("transformers", reason="the backbone tests build a Llama")


def _injector(**overrides) -> UserEmbeddingInjector:
    torch.manual_seed(0)
    return UserEmbeddingInjector(InjectorConfig(**{"user_dim": 8, "hidden_size": 16, **overrides}))


def test_soft_tokens_shape_and_per_token_layer_norm() -> None:
    injector = _injector(num_tokens=6, output_scale=0.5).eval()
    tokens = injector(torch.randn(3, 8) * 10)
    assert tokens.shape == (3, 6, 16)
    # Each soft token is normalized over D on its own, then scaled by the LayerNorm weight.
    torch.testing.assert_close(tokens.mean(-1), torch.zeros(3, 6), atol=1e-5, rtol=0)
    std = tokens.var(-1, unbiased=False).sqrt()
    torch.testing.assert_close(std, torch.full((3, 6), 0.5), atol=1e-3, rtol=0)


def test_dropout_only_in_training() -> None:
    injector = _injector(dropout=0.5)
    users = torch.randn(4, 8)
    injector.eval()
    torch.testing.assert_close(injector(users), injector(users))
    injector.train()
    assert not torch.allclose(injector(users), injector(users))


def test_injector_structure_follows_the_paper() -> None:
    injector = _injector(num_tokens=3, mlp_dim=32)
    assert (injector.up.in_features, injector.up.out_features) == (8, 32)
    assert (injector.down.in_features, injector.down.out_features) == (32, 3 * 16)
    assert injector.norm.normalized_shape == (16,)


def test_prepend_sets_mask_and_ignores_labels_on_soft_tokens() -> None:
    soft = torch.randn(2, 3, 16)
    prompt = torch.randn(2, 5, 16)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    labels = torch.arange(10).view(2, 5)
    embeds, full_mask, full_labels = prepend_soft_tokens(soft, prompt, mask, labels)
    assert embeds.shape == (2, 8, 16)
    torch.testing.assert_close(embeds[:, :3], soft)
    torch.testing.assert_close(embeds[:, 3:], prompt)
    assert full_mask[:, :3].eq(1).all() and full_mask[:, 3:].equal(mask)
    assert full_labels[:, :3].eq(IGNORE_INDEX).all() and full_labels[:, 3:].equal(labels)
    # Without a mask every prompt token counts; without labels none are returned.
    _, default_mask, no_labels = prepend_soft_tokens(soft, prompt)
    assert default_mask.eq(1).all() and no_labels is None


def test_only_the_injector_receives_gradients_through_a_frozen_llm(tiny_llama) -> None:
    llm = tiny_llama(50).requires_grad_(False)
    injector = _injector()
    ids = torch.randint(0, 50, (2, 7))
    soft = injector(torch.randn(2, 8))
    embeds, mask, labels = prepend_soft_tokens(soft, llm.get_input_embeddings()(ids), None, ids)
    loss = llm(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert all(p.grad is None for p in llm.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in injector.parameters())


def test_soft_tokens_change_the_llm_output(tiny_llama) -> None:
    llm = tiny_llama(50)
    ids = torch.randint(0, 50, (1, 5))
    embeds = llm.get_input_embeddings()(ids)
    injector = _injector().eval()
    a = prepend_soft_tokens(injector(torch.randn(1, 8)), embeds)
    b = prepend_soft_tokens(injector(torch.randn(1, 8)), embeds)
    with torch.no_grad():
        out_a = llm(inputs_embeds=a.inputs_embeds, attention_mask=a.attention_mask).logits
        out_b = llm(inputs_embeds=b.inputs_embeds, attention_mask=b.attention_mask).logits
    assert not torch.allclose(out_a[:, -1], out_b[:, -1])


def test_parameter_share_is_about_a_thousandth_of_a_1b_llm() -> None:
    # Llama-3.2-1B's shape (1.24B parameters), built on the meta device: nothing allocated.
    config = transformers.LlamaConfig(
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        llm = transformers.LlamaForCausalLM(config)
        injector = UserEmbeddingInjector(InjectorConfig(user_dim=64, hidden_size=2048))
    share = parameter_share(injector, llm)
    assert 0.0005 < share < 0.002, share
    check_backbone(injector, llm)


def test_bad_input_gets_a_clear_error(tiny_llama) -> None:
    injector = _injector()
    with pytest.raises(ValueError, match=r"\[batch, 8\]"):
        injector(torch.randn(2, 9))
    with pytest.raises(ValueError, match="floating point"):
        injector(torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"hidden size 16 .* have 12"):
        prepend_soft_tokens(torch.randn(2, 6, 16), torch.randn(2, 4, 12))
    with pytest.raises(ValueError, match="one per prompt"):
        prepend_soft_tokens(torch.randn(2, 6, 16), torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match="attention_mask"):
        prepend_soft_tokens(torch.randn(2, 6, 16), torch.randn(2, 4, 16), torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"backbone's hidden size is 24 .* soft tokens of 16"):
        check_backbone(injector, tiny_llama(50, hidden=24))
    with pytest.raises(TypeError, match="get_input_embeddings"):
        check_backbone(injector, nn.Linear(4, 4))
    for bad in (dict(num_tokens=0), dict(dropout=1.0), dict(output_scale=0.0), dict(user_dim=2.5)):
        with pytest.raises(ValueError):
            InjectorConfig(**{"user_dim": 8, "hidden_size": 16, **bad})
