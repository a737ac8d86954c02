"""The built-in models (``policy.model_name: builtin:NAME``): what config checks need to know of
them without torch. ``grpo_sdk.recipes.tiny_model`` builds them from these same facts."""

from __future__ import annotations

import attrs

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = tuple("0123456789abcdefgh+=>")  # the character tokenizer's vocabulary after the specials


@attrs.frozen(kw_only=True)
class BuiltinModel:
    n_positions: int  # the context length
    vocab_size: int
    # GPT-2's shape: the run plan counts the parameters from these without building the model.
    n_embd: int
    n_layer: int
    n_head: int


BUILTIN_MODELS = {"tiny-gpt2": BuiltinModel(n_positions=64, vocab_size=len(SPECIAL_TOKENS) + len(CHARACTERS),
                                            n_embd=64, n_layer=2, n_head=4)}
