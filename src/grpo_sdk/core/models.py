"""Finding model and tokenizer directories, with errors that name the config key and the path.

Tokenizers are Hugging Face tokenizers whatever the backend (vLLM, SGLang and Megatron recipes
all load them with transformers), so the training loop loads the tokenizer itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from grpo_sdk.core.errors import ModelLoadError
from grpo_sdk.core.hub import offline_hint, offline_mode, probe


def looks_local(name: str) -> bool:
    """Whether ``name`` can only be a local path: "org/model" and "model" may be hub ids, anything
    else (``./m``, ``/m``, ``~/m``, ``a/b/c``) is a path, missing if it does not exist."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def check_model_source(name: str, key: str = "policy.model_name") -> None:
    """A local path that does not exist is an error here, before transformers guesses it is a hub id."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{key}: {name} is a file; expected a model directory with config.json")
        if not (path / "config.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"{key}: {name} holds no config.json; is it a Hugging Face model directory?")
        return
    if looks_local(name):
        raise ModelLoadError(f"{key}: no model directory at {name}")


def load_pretrained(loader: Callable[..., Any], name: str, key: str, **kwargs: Any) -> Any:
    """``loader(name, **kwargs)`` (a ``from_pretrained``), failing within seconds when ``name`` is a hub
    id and the hub is out of reach: the cache is used then (``grpo_sdk.core.hub``), and a miss is a
    ModelLoadError naming ``key`` and what to do, never minutes of retries."""
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
