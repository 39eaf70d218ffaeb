"""A word-level tokenizer for the small backbone: one token per item ("item_123"), one per
prompt word, and BOS/EOS/PAD/UNK. No download is needed; it is saved beside the backbone
(`tokenizer.json`) so that `AutoTokenizer.from_pretrained(path)` loads it as it would load a
real checkpoint's tokenizer."""

from __future__ import annotations

from typing import Any

from loka.reprec.prompts import PromptTemplate

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "bos": "[BOS]", "eos": "[EOS]"}


def build_item_tokenizer(num_items: int, template: PromptTemplate | None = None) -> Any:
    """A `PreTrainedTokenizerFast` over the template's words and items 1..num_items; the
    encoding of a text starts with [BOS] when special tokens are asked for."""
    if num_items < 1:
        raise ValueError(f"num_items must be positive, got {num_items}")
    import tokenizers
    import transformers

    template = template or PromptTemplate()
    words = [*SPECIAL_TOKENS.values(), *template.words()]
    words += [template.item_text(i) for i in range(1, num_items + 1)]
    if len(set(words)) != len(words):
        raise ValueError("the template's words collide with item tokens or special tokens")
    vocab = {word: index for index, word in enumerate(words)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="[BOS] $A",
        pair="[BOS] $A $B",
        special_tokens=[("[BOS]", vocab["[BOS]"])],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **{f"{name}_token": token for name, token in SPECIAL_TOKENS.items()},
    )
