"""Finding model and tokenizer directories, with errors that name the config key and the path.

Tokenizers are Hugging Face tokenizers whatever the backend (vLLM, SGLang and Megatron recipes
all load them with transformers), so the training loop loads the tokenizer itself.
"""

from __future__ import annotations

from pathlib import Path

from grpo_sdk.core.errors import ModelLoadError


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


def load_tokenizer(name: str, key: str = "policy.tokenizer.name"):
    from transformers import AutoTokenizer

    check_model_source(name, key=key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise ModelLoadError(f"{key}: could not load {name!r}: {exc}".splitlines()[0]) from exc
    if tokenizer.pad_token_id is None:  # many causal LMs ship without a pad token
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
