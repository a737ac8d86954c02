"""The life of a run around the training step: validation, checkpoints, exact resume, Ctrl-C,
the save-by deadline, early stop, training-data dumps and the summary.

Exact resume: a checkpoint holds everything that decides what happens next (weights, optimizer
and LR schedule, the sampler's RNG, torch's and Python's RNGs, the dataloader position, the step
and group-id counters), so a run killed at any moment and resumed from its latest checkpoint
logs the same metrics and ends with bit-identical weights as a run never interrupted (CPU, one
thread). Metrics logged after the checkpoint are dropped on resume and logged again.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
from safetensors.torch import load_file, save_file

from grpo_sdk.core.checkpoint import STATE_FILE, CheckpointManager, ranking_metric
from grpo_sdk.core.config_checks import parse_duration
from grpo_sdk.core.errors import GrpoSdkError, NonFiniteError
from grpo_sdk.core.rollout import RolloutBatch, example_of
from grpo_sdk.core.run_dir import write_text_atomic
from grpo_sdk.core.signals import STOP, signal_name
from grpo_sdk.core.validation import validate


@attrs.frozen(kw_only=True)
class RunSummary:
    status: str  # completed, early_stop, deadline, interrupted, already_finished
    steps: int
    seconds: float  # wall time of this process's training
    reward_first: float  # mean reward of the first step: the starting level
    reward_last: float  # mean reward over the last min(10, steps) steps
    validation: dict[str, float]  # the last validation's metrics
    run_dir: Path
    checkpoint: Path | None  # the latest checkpoint: policy/ inside is a Hugging Face model directory
    example: dict[str, Any] | None  # one sample of the last step
    reason: str | None = None  # why an interrupted run stopped: the signal's name (SIGTERM, SIGINT, SIGHUP)

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "run_dir": str(self.run_dir),
                "checkpoint": str(self.checkpoint) if self.checkpoint else None}


# --- checkpoint contents ------------------------------------------------------------------------


def write_checkpoint(trainer: Any, directory: Path) -> None:
    trainer.policy.save_checkpoint(str(directory / "policy"))
    trainer.tokenizer.save_pretrained(str(directory / "policy"))  # policy/ is a complete HF model dir
    if hasattr(trainer.generation, "save_checkpoint"):
        trainer.generation.save_checkpoint(str(directory / "generation"))
    save_file({"torch": torch.get_rng_state()}, str(directory / "rng.safetensors"))


def trainer_state(trainer: Any, ranking: float | None) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"step": trainer.step, "next_group_id": trainer.next_group_id, "data": trainer.prompts.state_dict(),
            "python_random": [version, list(internal), gauss], "ranking_metric": ranking,
            "reward_first": trainer.reward_first, "reward_tail": trainer.reward_tail,
            "validation": trainer.last_validation}


def restore_checkpoint(trainer: Any, directory: Path) -> None:
    state = json.loads((directory / STATE_FILE).read_text())
    trainer.policy.load_checkpoint(str(directory / "policy"))
    if hasattr(trainer.generation, "load_checkpoint") and (directory / "generation").is_dir():
        trainer.generation.load_checkpoint(str(directory / "generation"))
    trainer.weight_sync.sync_weights(trainer.policy, trainer.generation, version=state["step"])
    torch.set_rng_state(load_file(str(directory / "rng.safetensors"))["torch"])
    version, internal, gauss = state["python_random"]
    random.setstate((version, tuple(internal), gauss))
    trainer.prompts.load_state_dict(state["data"])
    trainer.step, trainer.next_group_id = state["step"], state["next_group_id"]
    trainer.reward_first, trainer.reward_tail = state["reward_first"], state["reward_tail"]
    trainer.last_validation = state["validation"]


# --- dumps ----------------------------------------------------------------------------------------


def dump_batch(path: Path, rollouts: RolloutBatch, batch: Any) -> None:
    """One JSON object per sample, the seed's train_data_step*.jsonl fields."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, log in enumerate(rollouts.message_logs):
            row = {"content": [{"role": m.role, "content": m.content} for m in log],
                   "rewards": float(batch.rewards[i]) if batch is not None else float(rollouts.rewards[i])}
            if batch is not None:
                valid = batch.attention_mask[i].bool()
                row.update({
                    "input_lengths": int(valid.sum()), "token_ids": batch.input_ids[i][valid].tolist(),
                    "token_loss_mask": batch.token_mask[i][valid].tolist(),
                    "sample_loss_mask": float(batch.sample_mask[i]),
                    "advantages": batch.advantages[i][valid].tolist(),
                    "generation_logprobs": batch.generation_logprobs[i][valid].tolist(),
                    "prev_logprobs": batch.prev_logprobs[i][valid].tolist() if batch.prev_logprobs is not None else None,
                })
            f.write(json.dumps(row) + "\n")


# --- the run ----------------------------------------------------------------------------------------


def finished(trainer: Any) -> bool:
    """The run already reached its end (a resumed run with nothing left to do)."""
    grpo = trainer.config.grpo
    return trainer.step >= grpo.max_num_steps or trainer.prompts.epoch >= grpo.max_num_epochs


def run_training(trainer: Any, on_step: Callable[[int, dict[str, float]], None] | None = None) -> RunSummary:
    cfg = trainer.config
    grpo, ckpt = cfg.grpo, cfg.checkpointing
    manager: CheckpointManager = trainer.checkpoints
    hooks = trainer.registry.host
    start = time.perf_counter()
    deadline = parse_duration(ckpt.checkpoint_must_save_by) if ckpt.checkpoint_must_save_by else None
    status, error, rollouts, last_saved, validated_step = "failed", None, None, None, None
    step_seconds = 0.0
    if finished(trainer):  # resuming a finished run: nothing to log, nothing to save again
        return _summary(trainer, "already_finished", start, None)

    def log(step: int, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            try:
                logger.log_metrics(step, metrics)
            except OSError as exc:  # disk full, a vanished mount: name the file, keep the last checkpoint
                raise GrpoSdkError(f"could not write the metrics of step {step}: {exc}; the latest checkpoint "
                                   f"({manager.latest()}) is intact, resume from it once the storage is fixed") from exc

    def run_validation(step: int) -> dict[str, float]:
        metrics, batches = validate(trainer, step)
        trainer.last_validation = metrics
        if cfg.logger.dump_train_data:
            dump_batch(trainer.run_dir / "train_data" / f"val_step_{step}.jsonl", RolloutBatch.concat(batches), None)
        return {f"val/{k}": v for k, v in metrics.items()}

    def save(train_metrics: dict[str, float]) -> Path | None:
        nonlocal last_saved
        if not ckpt.enabled or last_saved == trainer.step:
            return None
        ranking = ranking_metric(ckpt.metric_name, train_metrics, trainer.last_validation)
        path = manager.save(trainer.step, lambda d: write_checkpoint(trainer, d), trainer_state(trainer, ranking))
        last_saved = trainer.step
        hooks.checkpoint_saved(run=trainer, step=trainer.step, path=str(path))
        return path

    own_handlers = not STOP.installed and STOP.install()  # a library caller gets the same signal handling
    if own_handlers:
        STOP.reset()
    hooks.run_start(run=trainer)
    try:
        STOP.deferred = True  # from here a first stop signal waits for the end of the step
        if STOP.requested:  # it came while the run started (and was swallowed there): no step, no save
            status = "interrupted"
        else:
            if grpo.val_at_start and trainer.step == 0 and trainer.val_prompts:
                log(0, run_validation(0))
            metrics: dict[str, float] = {}
            while trainer.step < grpo.max_num_steps and trainer.prompts.epoch < grpo.max_num_epochs:
                tick = time.perf_counter()
                try:
                    metrics, rollouts = trainer.train_step()
                except NonFiniteError as exc:
                    raise NonFiniteError(f"step {trainer.step + 1}: {exc}") from exc
                trainer.step += 1
                trainer.record_reward(metrics["reward/mean"])
                step = trainer.step
                last = step >= grpo.max_num_steps
                periodic = grpo.val_period > 0 and step >= grpo.val_start_at and step % grpo.val_period == 0
                validated = bool(trainer.val_prompts) and (periodic or (grpo.val_at_end and last))
                if validated:
                    metrics.update(run_validation(step))
                    validated_step = step
                log(step, metrics)
                hooks.step_end(run=trainer, step=step, metrics=metrics)
                if on_step is not None:
                    on_step(step, metrics)
                step_seconds = max(step_seconds, time.perf_counter() - tick)
                early = validated and reached(grpo, trainer.last_validation)
                late = deadline is not None and time.perf_counter() - start + 2 * step_seconds > deadline
                if step % ckpt.save_period == 0 or early or late or STOP.requested:
                    save(metrics)
                if STOP.requested or early or late:
                    status = "interrupted" if STOP.requested else "early_stop" if early else "deadline"
                    break
            else:
                status = "completed"
                if grpo.val_at_end and trainer.val_prompts and trainer.step and validated_step != trainer.step:
                    log(trainer.step, run_validation(trainer.step))  # the run ended by epochs, not steps
            save(metrics)
    except BaseException as exc:
        status, error = ("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"), exc
        if isinstance(exc, KeyboardInterrupt):  # stopped at once: say so in summary.json, then stop
            _summary(trainer, status, start, rollouts)
        raise
    finally:
        STOP.deferred = False
        if own_handlers:
            STOP.uninstall()
        for logger in trainer.loggers:
            logger.close()
        hooks.run_end(run=trainer, status=status, error=error)
    return _summary(trainer, status, start, rollouts)


def _summary(trainer: Any, status: str, start: float, rollouts: RolloutBatch | None) -> RunSummary:
    """The run's summary, also written to ``summary.json`` (atomically; a write error is reported, not raised)."""
    tail = trainer.reward_tail
    summary = RunSummary(status=status, steps=trainer.step, seconds=time.perf_counter() - start,
                         reward_first=trainer.reward_first if trainer.reward_first is not None else math.nan,
                         reward_last=sum(tail) / len(tail) if tail else math.nan,
                         validation=trainer.last_validation, run_dir=trainer.run_dir,
                         checkpoint=trainer.checkpoints.latest(), example=example_of(rollouts),
                         reason=signal_name(STOP.signum) if status == "interrupted" and STOP.signum else None)
    if status != "already_finished":
        try:
            write_text_atomic(trainer.run_dir / "summary.json", json.dumps(summary.to_json(), indent=2) + "\n")
        except OSError as exc:
            print(f"grpo-sdk: warning: could not write {trainer.run_dir / 'summary.json'}: {exc}", flush=True)
    return summary


def reached(grpo: Any, validation: dict[str, float]) -> bool:
    """Early stop: the chosen validation metric reached its threshold."""
    name = grpo.stop_at_validation_metric
    return name is not None and validation.get(name, -math.inf) >= grpo.stop_at_validation_threshold
