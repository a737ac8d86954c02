"""Finding model and tokenizer directories, with errors that name the config key and the path.

Tokenizers are Hugging Face tokenizers whatever the backend (vLLM, SGLang and Megatron recipes
all load them with transformers), so the training loop loads the tokenizer itself.

A model source is a hub id, a local model directory, a ``.gguf`` file or ``builtin:NAME``
(docs/models.md). ``resolve_model_source`` turns a GGUF file, and a built-in that is a packaged
GGUF file, into its cached model directory (``core.gguf_cache``); ``load_pretrained`` does so
first, so every loader that goes through it accepts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from grpo_sdk.core.builtin_models import packaged_file
from grpo_sdk.core.errors import ModelLoadError
from grpo_sdk.core.gguf_cache import cached_model_dir, check_gguf_file, gguf_model_dir, is_gguf, require_packages
from grpo_sdk.core.hub import offline_hint, offline_mode, probe


def looks_local(name: str) -> bool:
    """Whether ``name`` can only be a local path: "org/model" and "model" may be hub ids, anything
    else (``./m``, ``/m``, ``~/m``, ``a/b/c``) is a path, missing if it does not exist."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def resolve_model_source(name: str, key: str = "policy.model_name") -> str:
    """A GGUF file (or ``builtin:NAME`` of a packaged one) -> its cached model directory, converted on
    first use; any other name unchanged (``builtin:`` names that are built need a run directory:
    ``trainer.run_dir.initial_model_path``)."""
    packaged = packaged_file(name, key)
    if packaged is not None:
        return gguf_model_dir(str(packaged), key)
    if is_gguf(name):
        return gguf_model_dir(name, key)
    return name


def check_model_source(name: str, key: str = "policy.model_name") -> None:
    """A local path that does not exist is an error here, before transformers guesses it is a hub id.
    A GGUF file must start like one, and what converts it must be installed unless it was converted
    before (nothing is converted here)."""
    path = Path(name).expanduser()
    if is_gguf(name):
        check_gguf_file(name, key)
        if cached_model_dir(name) is None:
            require_packages(key, name)
        return
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{key}: {name} is a file; expected a model directory with config.json, "
                                 "or a .gguf file")
        if not (path / "config.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"{key}: {name} holds no config.json; is it a Hugging Face model directory?")
        return
    if looks_local(name):
        raise ModelLoadError(f"{key}: no model directory at {name}")


def load_pretrained(loader: Callable[..., Any], name: str, key: str, **kwargs: Any) -> Any:
    """``loader(name, **kwargs)`` (a ``from_pretrained``), failing within seconds when ``name`` is a hub
    id and the hub is out of reach: the cache is used then (``grpo_sdk.core.hub``), and a miss is a
    ModelLoadError naming ``key`` and what to do, never minutes of retries. A GGUF file loads from its
    cached model directory (converted first when it is not cached)."""
    name = resolve_model_source(name, key)
    check_model_source(name, key=key)
    unreachable = None if Path(name).expanduser().is_dir() else probe()
    try:
        if unreachable is None:
            return loader(name, **kwargs)
        with offline_mode():
            return loader(name, **kwargs)
    except OSError as exc:  # transformers reports a missing file, repo or connection as OSError
        first = f"{exc}".splitlines()[0] if f"{exc}".strip() else type(exc).__name__
        if unreachable is not None:
            raise ModelLoadError(f"{key}: {name!r} is not in the local cache and the hub cannot be reached "
                                 f"({unreachable}); {offline_hint('a local model directory (saved with save_pretrained)')}"
                                 ) from exc
        raise ModelLoadError(f"{key}: could not load {name!r}: {first}") from exc


def load_tokenizer(name: str, key: str = "policy.tokenizer.name"):
    from transformers import AutoTokenizer

    tokenizer = load_pretrained(AutoTokenizer.from_pretrained, name, key)
    if tokenizer.pad_token_id is None:  # many causal LMs ship without a pad token
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
