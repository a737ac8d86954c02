"""`grpoctl export RUN_DIR OUT`: the policy of a checkpoint as a standalone Hugging Face model dir."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import typer

from grpo_sdk.cli.common import guarded
from grpo_sdk.core.errors import ConfigError


def export(run_dir: Path = typer.Argument(..., help="A run directory."),
           out: Path = typer.Argument(..., help="Where to write the model directory (must not exist)."),
           step: Optional[int] = typer.Option(None, "--step", help="The checkpoint of this step; default: the latest."),
           best: bool = typer.Option(False, "--best", help="The best checkpoint by checkpointing.metric_name.")) -> None:
    """Copy a checkpoint's policy (config, safetensors, tokenizer) to OUT, ready for from_pretrained or vLLM."""
    guarded(lambda: _export(run_dir, out, step, best))


def _export(run_dir: Path, out: Path, step: int | None, best: bool) -> None:
    import yaml

    from grpo_sdk.trainer.checkpoint import CheckpointManager
    from grpo_sdk.core.config import CheckpointingConfig

    saved = run_dir / "config.resolved.yaml"
    raw = (yaml.safe_load(saved.read_text()) or {}).get("checkpointing", {}) if saved.is_file() else {}
    fields = {k: raw[k] for k in ("checkpoint_dir", "metric_name", "higher_is_better") if k in raw}
    manager = CheckpointManager(CheckpointingConfig(**fields), run_dir)
    found = manager.checkpoints()
    if not found:
        raise ConfigError([("RUN_DIR", f"{run_dir} holds no complete checkpoint")])
    if step is not None:
        chosen = next((p for p in found if p.name == f"step_{step}"), None)
        if chosen is None:
            raise ConfigError([("--step", f"no checkpoint of step {step}; have {', '.join(p.name for p in found)}")])
    else:
        chosen = manager.best() if best else found[-1]
    if out.exists():
        raise ConfigError([("OUT", f"{out} already exists")])
    shutil.copytree(chosen / "policy", out, ignore=shutil.ignore_patterns("optimizer.*"))
    print(f"exported {chosen / 'policy'} -> {out}")
