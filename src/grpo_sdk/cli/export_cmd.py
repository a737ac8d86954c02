"""`grpoctl export RUN_DIR OUT`: the policy of a checkpoint as a standalone Hugging Face model dir."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from grpo_sdk.cli.common import guarded


def export(run_dir: Path = typer.Argument(..., help="A run directory."),
           out: Path = typer.Argument(..., help="Where to write the model directory (must not exist)."),
           step: Optional[int] = typer.Option(None, "--step", help="The checkpoint of this step; default: the latest."),
           best: bool = typer.Option(False, "--best", help="The best checkpoint by checkpointing.metric_name."),
           lora: str = typer.Option("merged", "--lora", help="A LoRA checkpoint (policy.lora): 'merged' writes the "
                                    "base model with the adapters folded in (a plain model dir); 'adapter' the "
                                    "adapters only (a peft dir: PeftModel.from_pretrained).")) -> None:
    """Copy a checkpoint's policy (config, safetensors, tokenizer) to OUT, ready for from_pretrained or vLLM."""
    guarded(lambda: _export(run_dir, out, step, best, lora))


def _export(run_dir: Path, out: Path, step: int | None, best: bool, lora: str = "merged") -> None:
    from grpo_sdk.trainer.checkpoint import export_policy

    source = export_policy(run_dir, out, step=step, best=best, lora=lora)
    print(f"exported {source} -> {out}")
