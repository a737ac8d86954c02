"""A Weights & Biases run: every metric per step, the resolved config as the run config.

Select it with ``logger.loggers: [jsonl, wandb]``; its block::

    logger:
      wandb:
        project: grpo-sdk
        entity: null      # the account's default
        name: null        # null: the run directory's name
        mode: offline     # offline (default) | online | disabled
        dir: null         # null: <run_dir>, so the run writes <run_dir>/wandb/offline-run-*

The default mode is ``offline``: a run never needs an account or network, and nothing leaves
the machine unless asked. Upload later with ``wandb sync <run_dir>/wandb/offline-run-*``, or set
``mode: online`` (after ``wandb login``). The ``WANDB_MODE`` environment variable, when set,
overrides ``mode``, so a cluster or CI job can force offline without editing configs.
Needs ``pip install 'grpo-sdk[wandb]'``. (This module is not named ``wandb`` so that it does
not shadow the package.)

Metric keys go in as they are (``reward/mean`` becomes panel section ``reward``); NaN and
infinity are logged as they are (W&B stores them and leaves them out of line charts).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import wandb

from grpo_sdk.plugins import GrpoSdkError
from grpo_sdk.loggers.specs import WandbConfig, flat_config


class WandbLogger:
    def __init__(self, config: WandbConfig | None, context: Any):
        config = config or WandbConfig()
        run_dir = Path(context.run_dir)
        directory = Path(config.dir) if config.dir else run_dir
        directory.mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or config.mode
        try:
            self.run = wandb.init(
                project=config.project,
                entity=config.entity,
                name=config.name or run_dir.name,
                group=config.group,
                tags=list(config.tags) or None,
                mode=mode,
                dir=str(directory),
                config=flat_config(context.config),
            )
        except wandb.errors.Error as exc:  # no API key, server unreachable: a message, not a traceback
            raise GrpoSdkError(f"wandb (mode={mode}) could not start a run: {exc}; run `wandb login`, or set "
                               f"logger.wandb.mode=offline to log without an account") from exc

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        # An explicit step keeps W&B's x-axis equal to the training step (and to metrics.jsonl).
        self.run.log({key: float(value) for key, value in metrics.items()}, step=int(step))

    def close(self) -> None:
        # The loop closes loggers in a `finally`: an exception in flight means the run failed,
        # and W&B should show it as failed rather than finished.
        self.run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)
