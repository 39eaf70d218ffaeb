"""The dimensions of a Llama-style causal LM, read from its Hugging Face config."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loka.plora.config import LLAMA_TARGET_MODULES

# A GEMM size no backend takes (cuBLAS's sizes are 32-bit ints): no real model has one.
_MAX = 2**31 - 1


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only LM with Llama's linears (q, k, v, o, gate, up, down).

    Enough to count the base parameters, each LoRA adapter's parameters and the
    activations a training step keeps, without loading any weight.
    """

    num_layers: int
    hidden: int
    intermediate: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    target_modules: tuple[str, ...] = LLAMA_TARGET_MODULES

    def __post_init__(self) -> None:
        for key in (
            "num_layers",
            "hidden",
            "intermediate",
            "vocab",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{key} must be an integer >= 1, got {value!r}")
        unknown = sorted(set(self.target_modules) - set(self.linear_shapes()))
        if unknown:
            raise ValueError(
                f"target modules {unknown} are not Llama linears {sorted(self.linear_shapes())}"
            )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear of one decoder layer."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def num_params(self) -> int:
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden

    def adapter_params(self, rank: int) -> int:
        """Parameters of one rank-`rank` LoRA adapter on every target linear of every layer."""
        shapes = self.linear_shapes()
        return self.num_layers * sum(rank * sum(shapes[name]) for name in self.target_modules)

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | Any, target_modules: tuple[str, ...] = LLAMA_TARGET_MODULES
    ) -> ModelShape:
        """From a `transformers` config object, its dict, a `config.json` path or the
        checkpoint folder holding it."""
        where = "model config"
        if isinstance(config, str | Path):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"model config {path} does not exist")
            where = f"model config {path}"
            try:
                config = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"{where}: cannot read it ({err})") from None
            except ValueError as err:
                raise ValueError(f"{where}: malformed JSON: {err}") from None
        elif not isinstance(config, Mapping):
            config = config.to_dict()
        if not isinstance(config, Mapping):
            raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
        missing = [
            key
            for key in (
                "num_hidden_layers",
                "hidden_size",
                "intermediate_size",
                "vocab_size",
                "num_attention_heads",
            )
            if key not in config
        ]
        if missing:
            raise ValueError(f"{where} lacks {missing}; is it a Llama-style causal LM?")

        def size(key: str, default: int | None = None) -> int:
            value = config.get(key) if default is None else (config.get(key) or default)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX:
                raise ValueError(f"{where}: {key} must be an integer in [1, {_MAX}], got {value!r}")
            return value

        heads = size("num_attention_heads")
        hidden = size("hidden_size")
        try:
            return cls(
                num_layers=size("num_hidden_layers"),
                hidden=hidden,
                intermediate=size("intermediate_size"),
                vocab=size("vocab_size"),
                num_heads=heads,
                num_kv_heads=size("num_key_value_heads", heads),
                head_dim=size("head_dim", max(hidden // heads, 1)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                target_modules=tuple(target_modules),
            )
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
