"""The built-in models (``policy.model_name: builtin:NAME``): what config checks need to know of
them without torch. ``grpo_sdk.recipes.tiny_model`` builds them from these same facts."""

from __future__ import annotations

from typing import Any

import attrs

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = tuple("0123456789abcdefgh+=>")  # the character tokenizer's vocabulary after the specials


@attrs.frozen(kw_only=True)
class BuiltinModel:
    model_type: str  # config.json's: "gpt2" or "llama"
    n_positions: int  # the context length
    vocab_size: int
    n_embd: int  # hidden size
    n_layer: int
    n_head: int
    n_kv_head: int | None = None  # Llama's grouped-query attention; None: one per head
    intermediate_size: int | None = None  # Llama's MLP width; GPT-2's is 4 x n_embd

    def config_json(self) -> dict[str, Any]:
        """The shape keys of the config.json the builder writes: the run plan counts parameters and the
        backends' checks read heads and layers from these without building the model."""
        if self.model_type == "gpt2":
            return {"model_type": "gpt2", "vocab_size": self.vocab_size, "n_positions": self.n_positions,
                    "n_embd": self.n_embd, "n_layer": self.n_layer, "n_head": self.n_head}
        return {"model_type": self.model_type, "vocab_size": self.vocab_size,
                "max_position_embeddings": self.n_positions, "hidden_size": self.n_embd,
                "num_hidden_layers": self.n_layer, "num_attention_heads": self.n_head,
                "num_key_value_heads": self.n_kv_head or self.n_head, "intermediate_size": self.intermediate_size,
                "tie_word_embeddings": False}


_VOCAB = len(SPECIAL_TOKENS) + len(CHARACTERS)
BUILTIN_MODELS = {
    "tiny-gpt2": BuiltinModel(model_type="gpt2", n_positions=64, vocab_size=_VOCAB, n_embd=64, n_layer=2, n_head=4),
    # The Llama-shaped variant (RoPE, RMSNorm, SwiGLU, grouped-query attention): what the megatron
    # backend can build (mbridge converts Llama, not GPT-2).
    "tiny-llama": BuiltinModel(model_type="llama", n_positions=64, vocab_size=_VOCAB, n_embd=64, n_layer=2, n_head=4,
                               n_kv_head=2, intermediate_size=128),
}
