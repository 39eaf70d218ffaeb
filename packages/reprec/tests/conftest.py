"""The REPREC tests train tiny models (SASRec, a small Llama, the injector): one intra-op
thread each, so that pytest-xdist workers on a 2-core machine do not spin against each other
(as in loka-zoo's tests, where these tests lived)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_llama() -> Callable[..., torch.nn.Module]:
    """`tiny_llama(vocab, initializer_range=0.02, hidden=16)`: a seeded 2-layer Llama. With
    large initial weights (0.3) its answer reads its context; with the default (0.02) its
    logits are near zero whatever the input."""
    import transformers

    def build(vocab: int, initializer_range: float = 0.02, hidden: int = 16) -> torch.nn.Module:
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            initializer_range=initializer_range,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()

    return build
