"""`grpoctl run`: train. With no ``-c`` it trains the built-in recipe on the CPU."""

from __future__ import annotations

import datetime as dt
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from grpo_sdk.cli.common import guarded, load_plugin_modules
from grpo_sdk.core.errors import ConfigError
from grpo_sdk.trainer.run_dir import RunLock, check_storage
from grpo_sdk.trainer.signals import STOP, exit_code_of


def run(
    overrides: Optional[list[str]] = typer.Argument(None, help="Dotted overrides: grpo.num_prompts_per_step=8, "
                                                    "~key to reset a key to its default."),
    config: Optional[list[Path]] = typer.Option(None, "-c", "--config", help="Config YAML; repeat to layer files. "
                                                "Without one, the built-in recipe runs."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run directory; default "
                                           "<logger.log_dir>/grpo-<timestamp>."),
    plugin_modules: Optional[list[str]] = typer.Option(None, "-p", "--plugin", help="Import MODULE as a hook "
                                                       "plugin for this run (quick hacks, like pytest -p)."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help="Progress bar; default: "
                                            "on when stdout is a terminal."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in RUN_DIR from its latest "
                                          "checkpoint, with its saved config (overrides still apply)."),
) -> None:
    """Train with GRPO. Writes config, plugin versions, metrics.jsonl and checkpoints to the run dir.

    A run directory that already holds checkpoints is resumed from the latest one.
    """
    files = [str(c) for c in config or []]
    if resume is not None:
        saved = resume / "config.resolved.yaml"
        if not saved.is_file():
            guarded(lambda: _fail_resume(resume))
        files = [str(saved), *files]
        run_dir = run_dir or resume
    guarded(lambda: _run(overrides or [], files, run_dir, plugin_modules or [], progress, resume is not None))


def _fail_resume(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise ConfigError([("--resume", f"{run_dir} does not exist or is not a directory")])
    if any(run_dir.iterdir()):  # a run that was stopped before it could write its config
        raise ConfigError([("--resume", f"{run_dir} holds no config.resolved.yaml: the run there stopped before "
                                        "it wrote its config, so it never trained and there is nothing to resume. "
                                        f"Start it again with `grpoctl run [-c ...] --run-dir {run_dir}`")])
    raise ConfigError([("--resume", f"{run_dir} is not a run directory (it is empty)")])


def _finished_message(manager, cfg) -> str | None:
    """Torch-free: "already finished" when the latest checkpoint is at max_num_steps and verifies."""
    import json

    from grpo_sdk.trainer.checkpoint import STATE_FILE, verify

    latest = manager.latest()
    try:
        step = json.loads((latest / STATE_FILE).read_text(encoding="utf-8"))["step"] if latest else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damaged: the trainer's verification reports it and falls back
    if not isinstance(step, int) or step < cfg.grpo.max_num_steps or verify(latest) is not None:
        return None
    return (f"the run already finished: its latest checkpoint ({latest}) is at step {step} and "
            f"grpo.max_num_steps is {cfg.grpo.max_num_steps}; nothing to do. Raise grpo.max_num_steps to train further.")


def _run(overrides: list[str], files: list[str], run_dir: Path | None, plugin_modules: list[str],
         progress: bool | None, resume: bool) -> None:
    from grpo_sdk.trainer.checkpoint import CheckpointManager
    from grpo_sdk.core.config_loader import load_config

    registry = load_plugin_modules(plugin_modules)
    cfg = load_config(files, overrides, registry)
    run_dir = run_dir or Path(cfg.logger.log_dir) / dt.datetime.now().strftime("grpo-%Y%m%d-%H%M%S")
    manager = CheckpointManager(cfg.checkpointing, run_dir)
    check_storage(run_dir, manager.directory if cfg.checkpointing.enabled else None)
    RunLock(run_dir).acquire()  # held until the process exits; before anything reads or writes the run dir
    resume = resume or manager.latest() is not None
    if resume and (message := _finished_message(manager, cfg)):
        manager.remove_partial()  # a kill while the last save pruned may have left a half-deleted one
        print(message)
        return
    if (run_dir / "metrics.jsonl").exists() and not resume:
        raise ConfigError([("--run-dir", f"{run_dir} already holds a run without a checkpoint (metrics.jsonl); "
                                         "choose another directory, or restart it with --resume")])

    from grpo_sdk.trainer.trainer import GRPOTrainer  # imports torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file load/save bars drown the training progress

    show_bar = progress if progress is not None else (sys.stdout.isatty() and not os.environ.get("CI"))
    total = cfg.grpo.max_num_steps
    print(f"grpoctl run: {cfg.policy.model_name} | {cfg.env.name} | {cfg.grpo.adv_estimator.name} | "
          f"{cfg.grpo.num_prompts_per_step} prompts x {cfg.grpo.num_generations_per_prompt} generations | "
          f"{total} steps | run dir {run_dir}", flush=True)
    trainer = GRPOTrainer(cfg, run_dir=run_dir, registry=registry, resume=resume)
    try:  # a failed setup must free what it started too (Ray actors, placement groups)
        trainer.setup()
        if trainer.step:
            print(f"resumed from step {trainer.step} ({trainer.checkpoints.latest()})", flush=True)
        reporter = BarReporter(total, trainer.step) if show_bar else LineReporter(total)
        with reporter:
            summary = trainer.train(on_step=reporter.update)
    finally:
        trainer.shutdown()
    if summary.status == "already_finished":
        print(f"the run in {run_dir} already finished at step {summary.steps}; nothing to do")
        return
    ending = {"early_stop": " (early stop: validation threshold reached)",
              "deadline": " (stopped to meet checkpointing.checkpoint_must_save_by)",
              "interrupted": f" (stopped by {summary.reason}; resume with grpoctl run --resume {run_dir})",
              }.get(summary.status, "")
    print(f"\nreward {summary.reward_first:.3f} -> {summary.reward_last:.3f} (first step -> mean of the last "
          f"{min(10, summary.steps)}) in {summary.steps} steps, {summary.seconds:.1f} s{ending}")
    if summary.validation:
        print("validation: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.validation.items() if k != "num_samples"))
    if summary.example:
        ex = summary.example
        print(f"example: {ex['prompt']!r} -> {ex['response']!r} (reward {ex['reward']:.2f})")
    print(f"run dir: {summary.run_dir}")
    if summary.checkpoint:
        print(f"checkpoint: {summary.checkpoint} (policy/ is a Hugging Face model directory; "
              f"grpoctl export {summary.run_dir} DIR copies it)")
    if summary.status == "interrupted":
        print("interrupted", file=sys.stderr)
        raise typer.Exit(exit_code_of(STOP.signum or signal.SIGINT))


def _fields(metrics: dict[str, float]) -> tuple[float, float, float]:
    return metrics["reward/mean"], metrics.get("kl_penalty", 0.0), metrics["perf/tokens_per_sec"]


class LineReporter:
    """Plain lines, for logs and pipes: the first step, about 40 lines in between, and the last."""

    def __init__(self, total: int):
        self.total = total
        self.every = max(1, total // 40)
        self.start = time.perf_counter()

    def __enter__(self) -> LineReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if step == 1 or step % self.every == 0 or step == self.total:
            reward, kl, tps = _fields(metrics)
            print(f"step {step}/{self.total}  reward {reward:.3f}  kl {kl:.4f}  tok/s {tps:,.0f}  "
                  f"elapsed {time.perf_counter() - self.start:.1f}s", flush=True)


class BarReporter:
    """A Rich progress bar on a terminal."""

    def __init__(self, total: int, completed: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), TimeRemainingColumn())
        self.task = self.progress.add_task("train", total=total, completed=completed, info="")

    def __enter__(self) -> BarReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        reward, kl, tps = _fields(metrics)
        self.progress.update(self.task, completed=step,
                             info=f"reward {reward:.3f}  kl {kl:.4f}  {tps:,.0f} tok/s")
