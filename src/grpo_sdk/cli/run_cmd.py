"""`grpoctl run`: train. With no ``-c`` it trains the built-in recipe on the CPU."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import attrs
import typer

from grpo_sdk.cli.common import guarded, load_plugin_modules
from grpo_sdk.core.errors import ConfigError
from grpo_sdk.trainer.signals import STOP, exit_code_of


def run(
    overrides: Optional[list[str]] = typer.Argument(None, help="Dotted overrides: grpo.num_prompts_per_step=8, "
                                                    "~key to reset a key to its default."),
    config: Optional[list[Path]] = typer.Option(None, "-c", "--config", help="Config YAML; repeat to layer files. "
                                                "Without one, the built-in recipe runs."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run directory; default "
                                           "<logger.log_dir>/grpo-<timestamp>. One that holds checkpoints is "
                                           "resumed, as with --resume."),
    plugin_modules: Optional[list[str]] = typer.Option(None, "-p", "--plugin", help="Import MODULE as a hook "
                                                       "plugin for this run (quick hacks, like pytest -p)."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help="Progress bar; default: "
                                            "on when stdout is a terminal."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in RUN_DIR from its latest "
                                          "checkpoint, with its saved config (resumable overrides still apply)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Train at most N steps: the same as "
                                            "grpo.max_num_steps=N, after every other override."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Resolve and check the config, print the run plan "
                                 "(components, rows and tokens per step, memory estimate), and build nothing."),
) -> None:
    """Train with GRPO. Writes config, plugin versions, metrics.jsonl and checkpoints to the run dir.

    A run directory that already holds checkpoints is resumed from the latest one with its saved
    config; overrides may change only the resumable keys (steps, epochs, logging, checkpoint cadence,
    the Ray cluster.address).
    """
    overrides = list(overrides or [])
    if max_steps is not None:
        overrides.append(f"grpo.max_num_steps={max_steps}")
    request = RunRequest(overrides=overrides, files=[str(c) for c in config or []], run_dir=resume or run_dir,
                         plugin_modules=list(plugin_modules or []), progress=progress, resume=resume is not None)
    guarded(lambda: _dry_run(request) if dry_run else _run(request))


@attrs.frozen(kw_only=True)
class RunRequest:
    overrides: list[str]
    files: list[str]
    run_dir: Path | None
    plugin_modules: list[str]
    progress: bool | None
    resume: bool  # --resume: the run directory must hold a run

    def resume_command(self, run_dir: Path) -> str:
        plugins = "".join(f" -p {shlex.quote(m)}" for m in self.plugin_modules)
        return f"grpoctl run{plugins} --resume {shlex.quote(str(run_dir))}"


def _dry_run(request: RunRequest) -> None:
    from grpo_sdk.cli.plan import run_plan
    from grpo_sdk.cli.preflight import preflight
    from grpo_sdk.trainer.launch import default_run_dir, resolve_config

    registry = load_plugin_modules(request.plugin_modules)
    cfg, resuming = resolve_config(request.files, request.overrides, request.run_dir, registry, resume=request.resume)
    prompt_lengths: list[int] = []  # the longest prompt of each source preflight tokenized: the memory plan's
    problems = preflight(cfg, registry, prompt_lengths=prompt_lengths)
    if problems:
        raise ConfigError(problems)
    run_dir = request.run_dir or default_run_dir(cfg)
    print(f"dry run: nothing is built or written. Run dir {run_dir}" + (" (resumes its latest checkpoint)"
                                                                          if resuming else ""))
    print(run_plan(cfg, registry, longest_prompt=max(prompt_lengths, default=None)).rstrip())


def _run(request: RunRequest) -> None:
    from grpo_sdk.trainer.launch import default_run_dir, epoch_note, open_run, resolve_config, run_trainer

    registry = load_plugin_modules(request.plugin_modules)
    cfg, resuming = resolve_config(request.files, request.overrides, request.run_dir, registry, resume=request.resume)
    run_dir = request.run_dir or default_run_dir(cfg)
    opened = open_run(cfg, run_dir, resume=resuming)
    if opened.finished:
        opened.release()
        print(opened.finished)
        return

    show_bar = request.progress if request.progress is not None else (sys.stdout.isatty() and not os.environ.get("CI"))
    total = cfg.grpo.max_num_steps
    print(f"grpoctl run: {cfg.policy.model_name} | {cfg.env.name} | {cfg.grpo.adv_estimator.name} | "
          f"{cfg.grpo.num_prompts_per_step} prompts x {cfg.grpo.num_generations_per_prompt} generations | "
          f"{total} steps | run dir {run_dir}", flush=True)
    reporter: LineReporter | BarReporter | None = None

    def on_setup(trainer) -> None:
        nonlocal reporter
        if trainer.step:
            print(f"resumed from step {trainer.step} ({trainer.checkpoints.latest()})", flush=True)
        if note := epoch_note(cfg, trainer.components.prompts):
            print(f"note: {note}", flush=True)
        reporter = BarReporter(total, trainer.step) if show_bar else LineReporter(total)
        reporter.__enter__()

    def on_step(step: int, metrics: dict[str, float]) -> None:
        reporter.update(step, metrics)

    try:
        summary = run_trainer(cfg, opened, registry, on_setup=on_setup, on_step=on_step)
    except KeyboardInterrupt:  # a second signal stopped it at once: say where to pick it up
        _close(reporter)
        _print_resume(request, run_dir)
        raise
    finally:  # a failed run too: a live progress bar would garble the error printed after it
        _close(reporter)
    if summary.status == "already_finished":
        print(f"the run in {run_dir} already finished at step {summary.steps}; nothing to do")
        return
    ending = {"early_stop": " (early stop: validation threshold reached)",
              "deadline": " (stopped to meet checkpointing.checkpoint_must_save_by)",
              "interrupted": f" (stopped by {summary.reason or 'a signal'})",
              }.get(summary.status, "")
    if summary.ended_by == "grpo.max_num_epochs":
        ending = (f" (grpo.max_num_epochs={cfg.grpo.max_num_epochs}: the dataset's epochs ran out before "
                  f"grpo.max_num_steps={total}; raise grpo.max_num_epochs to train longer)")
    print(f"\nreward {summary.reward_first:.3f} -> {summary.reward_last:.3f} (first step -> mean of the last "
          f"{min(10, summary.steps)}) in {summary.steps} steps, {summary.seconds:.1f} s{ending}")
    if summary.validation:
        print("validation: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.validation.items() if k != "num_samples"))
    if summary.example:
        ex = summary.example
        print(f"example: {ex['prompt']!r} -> {ex['response']!r} (reward {ex['reward']:.2f})")
    print(f"run dir: {summary.run_dir}")
    if summary.checkpoint:
        if (Path(summary.checkpoint) / "policy" / "adapter_config.json").is_file():  # policy.lora
            print(f"checkpoint: {summary.checkpoint} (policy/ holds LoRA adapters, a peft directory; "
                  f"grpoctl export {summary.run_dir} DIR merges them into a model directory)")
        else:
            print(f"checkpoint: {summary.checkpoint} (policy/ is a Hugging Face model directory; "
                  f"grpoctl export {summary.run_dir} DIR copies it)")
    if summary.status == "interrupted":
        print(f"resume: {request.resume_command(run_dir)}")
        print("interrupted", file=sys.stderr)
        raise typer.Exit(exit_code_of(STOP.signum or signal.SIGINT))


def _close(reporter: LineReporter | BarReporter | None) -> None:
    if reporter is not None:
        reporter.__exit__(None, None, None)  # idempotent: Rich's stop() on a stopped bar does nothing


def _print_resume(request: RunRequest, run_dir: Path) -> None:
    from grpo_sdk.trainer.launch import saved_config_of

    if saved_config_of(run_dir) is None:
        print(f"\nstopped before the first checkpoint; nothing to resume in {run_dir}", flush=True)
        return
    from grpo_sdk.trainer.checkpoint import saved_manager

    try:
        latest = saved_manager(run_dir).latest()
    except Exception:  # noqa: BLE001 - the hint is best effort; the exit code still says interrupted
        latest = None
    print(f"\ncheckpoint: {latest}\nresume: {request.resume_command(run_dir)}", flush=True)


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
