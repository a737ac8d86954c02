"""What every component is constructed with, besides its own config block."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.config.schema import MasterConfig
from grpo_sdk.core.models import looks_local


def absolute_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as an absolute, normalised path (``~`` expanded); relative ones are taken from the
    current directory now, so a component that changes directory, or runs in another process, or
    resumes later from elsewhere, still finds it."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def absolute_model_source(name: str | os.PathLike[str]) -> str:
    """A model or tokenizer source: a local path made absolute (``absolute_dir``), a hub id
    (``Qwen/Qwen2.5-1.5B``, which names no local directory) unchanged."""
    name = os.fspath(name)
    if looks_local(name) or Path(name).expanduser().exists():
        return str(absolute_dir(name))
    return name


@attrs.frozen(kw_only=True)
class RunContext:
    """The run a component belongs to.

    Components read shared settings from ``config`` (for example a policy backend reads
    ``config.policy.optimizer``) and their own options from the block they are constructed with.
    Paths are absolute whoever builds the context (relative ones are resolved against the current
    directory when it is built): ``run_dir`` always, ``model_path`` / ``tokenizer_path`` when they
    name a local directory (a hub id stays as written). The trainer loads the tokenizer before it
    builds any component and passes its ``eos_token_id`` and ``pad_token_id`` (pad falls back to
    EOS when the tokenizer has none), so a backend that talks to a server need not load
    transformers to learn two integers.
    """

    config: MasterConfig
    run_dir: Path = attrs.field(converter=absolute_dir)
    model_path: str = attrs.field(converter=absolute_model_source)  # policy.model_name; `builtin:` names built into a directory
    tokenizer_path: str = attrs.field(converter=absolute_model_source)  # policy.tokenizer.name or model_path
    device: str  # "cpu" or "cuda"
    seed: int  # grpo.seed
    needs_reference: bool  # the loss has a KL penalty, so the policy keeps a frozen reference copy
    registry: Any = None
    resume_step: int | None = None  # resuming: the checkpoint's step (0: none yet); loggers drop later steps
    rank: int = 0  # this worker's rank in its worker group (policy ranks share a torch.distributed group)
    world_size: int = 1  # ranks in the worker group; > 1: the runtime has initialised torch.distributed
    eos_token_id: int | None = None  # the tokenizer's EOS id (None: the context was built without a tokenizer)
    pad_token_id: int | None = None  # the tokenizer's pad id, EOS when it has none (as load_tokenizer sets it)
