"""A model's parameter count without torch and without reading its weights (the run plan's memory estimate).

In order of preference:

1. ``builtin:NAME``: the shape the built-in model is built with (``core.builtin_models``).
   A GGUF file: its cached model directory's config.json when it was converted before, else the
   tensor shapes in its header (gguf's reader maps the file; nothing is dequantized).
2. A local Hugging Face model directory of a known architecture: computed from ``config.json``
   (GPT-2, and the Llama family: Llama, Mistral, Qwen2, Qwen3), exactly as transformers builds the
   model (tests compare with ``sum(p.numel() for p in model.parameters())``; tied embeddings count once).
3. Any other local directory: the tensor shapes in its ``.safetensors`` headers (a JSON header at
   the start of each file, read without loading a tensor).

A hub name is not counted: nothing is downloaded for a plan.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable

import attrs

from grpo_sdk.core.builtin_models import BUILTIN_MODELS
from grpo_sdk.core.gguf_cache import INSTALL, cached_model_dir, gguf_parameters, is_gguf

MAX_HEADER_BYTES = 100 * 2**20  # a real header is KiBs to a few MiBs; larger means this is not a safetensors file


@attrs.frozen(kw_only=True)
class ModelSize:
    params: int | None  # None: not counted, ``how`` says why
    how: str  # where the count comes from, or why there is none
    vocab_size: int | None = None


def model_size(name: str) -> ModelSize:
    """The parameter count of ``policy.model_name`` (or a teacher's), as far as it can be known here."""
    if name.startswith("builtin:"):
        facts = BUILTIN_MODELS.get(name.removeprefix("builtin:"))
        if facts is None:
            return ModelSize(params=None, how=f"{name} is not a built-in model")
        how = f"the shape {name} is built with" if facts.packaged is None else \
            f"the config of {facts.packaged.filename}, which {name} names"
        return ModelSize(params=architecture_parameters(facts.config_json()), how=how, vocab_size=facts.vocab_size)
    path = Path(name).expanduser()
    if is_gguf(name) and path.is_file():
        return _gguf_size(name)
    if not path.is_dir():
        cached = _cached_config(name)
        if cached is None:
            return ModelSize(params=None, how="not counted: not a local model directory, and the hub cache holds no "
                                              "config.json of it (nothing is downloaded for a plan)")
        config = _read_config(cached)
        params = architecture_parameters(config)
        how = f"config.json in the hub cache ({config.get('model_type')})" if params is not None else \
            f"not counted: architecture {config.get('model_type')!r} is not one the plan knows"
        return ModelSize(params=params, how=how, vocab_size=_vocab(config))
    config = _read_config(path / "config.json")
    vocab = _vocab(config)
    params = architecture_parameters(config)
    if params is not None:
        return ModelSize(params=params, how=f"config.json ({config['model_type']})", vocab_size=vocab)
    try:
        params, files = safetensors_parameters(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged header: the plan says so, the run fails
        return ModelSize(params=None, how=f"not counted: {type(exc).__name__}: {exc}", vocab_size=vocab)
    if params is None:
        kind = f"architecture {config.get('model_type')!r}" if config.get("model_type") else "no config.json"
        return ModelSize(params=None, how=f"not counted: {kind} is not one the plan knows, and {path} holds no "
                                          ".safetensors files", vocab_size=vocab)
    return ModelSize(params=params, how=f"the headers of {files} .safetensors file{'s' * (files > 1)}",
                     vocab_size=vocab)


def _gguf_size(name: str) -> ModelSize:
    directory = cached_model_dir(name)
    if directory is not None:
        return model_size(str(directory))
    try:
        params, facts = gguf_parameters(name)
    except ImportError:
        return ModelSize(params=None, how=f"not counted: reading a GGUF file needs the gguf package ({INSTALL})")
    except Exception as exc:  # noqa: BLE001 - a damaged file: the plan says so, the run fails with the details
        return ModelSize(params=None, how=f"not counted: gguf cannot read {name} ({type(exc).__name__})")
    return ModelSize(params=params, how=f"the tensor table of the GGUF file ({facts.get('model_type')})",
                     vocab_size=_vocab(facts))


def _cached_config(name: str) -> Path | None:
    """The config.json of hub model ``name`` in the local hub cache, or None; never a download."""
    from grpo_sdk.core.models import looks_local

    if looks_local(name):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id, an unreadable cache: nothing to count from
        return None
    return Path(found) if isinstance(found, str) else None


def _vocab(config: dict[str, Any]) -> int | None:
    return config["vocab_size"] if isinstance(config.get("vocab_size"), int) else None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


# --- from the architecture -------------------------------------------------------------------------


def _gpt2(c: dict[str, Any]) -> int | None:
    if c.get("add_cross_attention"):
        return None  # an encoder-decoder variant: the headers count it
    d, layers = c.get("n_embd", 768), c.get("n_layer", 12)  # GPT2Config's defaults, which config.json may omit
    inner = c.get("n_inner") or 4 * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)  # c_attn and c_proj (Conv1D: weight and bias)
    mlp = (d * inner + inner) + (inner * d + d)
    layer = 2 * d + attention + 2 * d + mlp  # ln_1, ln_2: weight and bias
    embeddings = c.get("vocab_size", 50257) * d + c.get("n_positions", 1024) * d
    head = 0 if c.get("tie_word_embeddings", True) else c.get("vocab_size", 50257) * d
    return embeddings + layers * layer + 2 * d + head


# model_type -> (q/k/v biases, o_proj bias, per-head q/k RMSNorms); None: config.attention_bias decides.
LLAMA_FAMILY: dict[str, tuple[bool | None, bool | None, bool]] = {
    "llama": (None, None, False),
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (None, None, True),
}


def _llama_family(c: dict[str, Any]) -> int | None:
    qkv_bias, o_bias, qk_norm = LLAMA_FAMILY[c["model_type"]]
    try:
        d, inner, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        heads, vocab = c["num_attention_heads"], c["vocab_size"]
    except KeyError:
        return None
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or d // heads
    qkv_bias = c.get("attention_bias", False) if qkv_bias is None else qkv_bias
    o_bias = c.get("attention_bias", False) if o_bias is None else o_bias
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = d * q + 2 * d * kv + q * d + (q + 2 * kv if qkv_bias else 0) + (d if o_bias else 0)
    mlp = 3 * d * inner + (2 * inner + d if c.get("mlp_bias", False) else 0)  # gate, up, down
    norms = 2 * d + (2 * head_dim if qk_norm else 0)
    head = 0 if c.get("tie_word_embeddings", False) else vocab * d
    return vocab * d + layers * (attention + mlp + norms) + d + head


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], int | None]] = {
    "gpt2": _gpt2, **{name: _llama_family for name in LLAMA_FAMILY}}


def architecture_parameters(config: dict[str, Any]) -> int | None:
    """Parameters of the causal LM transformers builds from ``config`` (a config.json's dict), or None
    for an architecture not in ``ARCHITECTURES`` or a config missing a size."""
    count = ARCHITECTURES.get(config.get("model_type", ""))
    try:
        return count(config) if count is not None else None
    except (TypeError, ZeroDivisionError):  # a size that is not a number
        return None


# --- from the safetensors headers ------------------------------------------------------------------


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short to be a .safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a header of {length} bytes; not a .safetensors file")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path}: the header is not JSON; not a .safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    return header


def safetensors_parameters(directory: Path) -> tuple[int | None, int]:
    """(elements of every tensor in the directory's safetensors files, number of files); (None, 0) without any.
    The shard index (``model.safetensors.index.json``) names the files when there is one."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None, 0
    total = 0
    for file in files:
        for name, entry in safetensors_header(file).items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            total += count
    return total, len(files)
