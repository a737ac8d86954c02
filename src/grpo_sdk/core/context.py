"""What every component is constructed with, besides its own config block."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.core.config import MasterConfig


@attrs.frozen(kw_only=True)
class RunContext:
    """The run a component belongs to.

    Components read shared settings from ``config`` (for example a policy backend reads
    ``config.policy.optimizer``) and their own options from the block they are constructed with.
    """

    config: MasterConfig
    run_dir: Path
    model_path: str  # policy.model_name, with `builtin:` names already built into a directory
    tokenizer_path: str  # policy.tokenizer.name or model_path
    device: str  # "cpu" or "cuda"
    seed: int
    needs_reference: bool  # the loss has a KL penalty, so the policy keeps a frozen reference copy
    registry: Any = None
    resume_step: int | None = None  # resuming: the checkpoint's step (0: none yet); loggers drop later steps
    rank: int = 0  # this worker's rank in its worker group (policy ranks share a torch.distributed group)
    world_size: int = 1  # ranks in the worker group; > 1: the runtime has initialised torch.distributed
