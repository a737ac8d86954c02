"""Opening a run directory and running the trainer in it: what `grpoctl run` and the Python API
(``grpo_sdk.train``, ``grpo_sdk.Trainer``) share, so both do exactly the same run.

* Which config a run directory gets: a directory that already holds checkpoints resumes with
  its saved ``config.resolved.yaml`` (files and overrides layered on top, as ``--resume`` does),
  and a change to anything but the resumable keys (steps, epochs, logging, checkpoint cadence,
  the Ray cluster.address) is refused with the difference shown: a 5-digit run must not silently continue as an 8-digit one.
* The run directory's lock, the "already finished" answer, the refusal to write a second run's
  metrics into a directory without a checkpoint.
* Third-party progress bars (transformers' shard writing, huggingface_hub, datasets) are off while
  the run is set up and trains, and come back on afterwards: a notebook shows nothing it did not
  ask for.

Torch-free until ``run_trainer`` builds the trainer.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import attrs

from grpo_sdk.core.errors import ConfigError
from grpo_sdk.trainer.run_dir import RunLock, check_storage

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

SAVED_CONFIG = "config.resolved.yaml"
# Keys a resumed run may change: how long it trains, how it logs, how often it saves. Anything
# else changes what the checkpoint's state means (the task, the model, the optimizer, the data order).
RESUMABLE_KEYS = (
    "grpo.max_num_steps", "grpo.max_num_epochs", "logger",
    "checkpointing.save_period", "checkpointing.keep_top_k", "checkpointing.checkpoint_must_save_by",
    # Async GRPO: how the resumed run treats its replay buffer, and how long it waits (docs/async.md).
    "checkpointing.load_replay_buffer", "grpo.async_grpo.max_trajectory_age_steps",
    "grpo.async_grpo.starvation_timeout_s",
    # Where the Ray cluster is: a head restarted after a lost node listens on a new port.
    "cluster.address",
)
MAX_SHOWN_CHANGES = 20


def default_run_dir(cfg: MasterConfig) -> Path:
    return Path(cfg.logger.log_dir) / dt.datetime.now().strftime("grpo-%Y%m%d-%H%M%S")


def saved_config_of(run_dir: Path | None) -> Path | None:
    """The saved config of a run directory that holds at least one checkpoint, else None."""
    if run_dir is None:
        return None
    saved = Path(run_dir) / SAVED_CONFIG
    if not saved.is_file():
        return None
    from grpo_sdk.trainer.checkpoint import saved_manager

    try:  # only where the checkpoints are: the rest of the saved config is loaded (and checked) later
        manager = saved_manager(Path(run_dir))
    except Exception:  # noqa: BLE001 - an unreadable saved config is reported when it is loaded
        return saved
    return saved if manager.latest() is not None else None


def config_changes(saved: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, new value)`` for every leaf that differs, resumable keys left out."""
    from grpo_sdk.config.loading import dump_config

    missing = object()
    changes: list[tuple[str, Any, Any]] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in list(a) + [k for k in b if k not in a]:
                walk(f"{prefix}.{key}" if prefix else str(key), a.get(key, missing), b.get(key, missing))
        elif a != b and not any(prefix == k or prefix.startswith(k + ".") for k in RESUMABLE_KEYS):
            changes.append((prefix, a, b))

    walk("", dump_config(saved), dump_config(new))
    return [(k, "(absent)" if a is missing else a, "(absent)" if b is missing else b) for k, a, b in changes]


def check_resumable(saved: Any, new: Any, run_dir: Path) -> None:
    """A ConfigError listing what a resume of ``run_dir`` would change, unless it changes only resumable keys."""
    changes = config_changes(saved, new)
    if not changes:
        return
    shown = [f"{key}: {old!r} (saved) -> {value!r}" for key, old, value in changes[:MAX_SHOWN_CHANGES]]
    if len(changes) > MAX_SHOWN_CHANGES:
        shown.append(f"... and {len(changes) - MAX_SHOWN_CHANGES} more")
    raise ConfigError([("--run-dir", f"{run_dir} holds checkpoints of a run with another config, and resuming "
                                     "would change it:\n    " + "\n    ".join(shown) + "\n  A resume may change only "
                                     f"{', '.join(RESUMABLE_KEYS)}. Start the new config in another --run-dir, or "
                                     "drop those changes to continue the saved run.")])


def resolve_config(files: list[str], overrides: list[str], run_dir: Path | None, registry: Any, *,
                   resume: bool = False) -> tuple[Any, bool]:
    """``(config, resuming)`` as `grpoctl run` resolves it: the built-in recipe when there are no files;
    in a run directory with checkpoints (or with ``resume``), the saved config with files and overrides
    on top, and only resumable changes allowed."""
    from grpo_sdk.config.loading import load_config

    saved = saved_config_of(run_dir)
    if resume and saved is None:
        saved = _saved_for_resume(run_dir)
    if saved is None:
        return load_config(files, overrides, registry), False
    base = load_config([str(saved)], [], registry)
    cfg = load_config([str(saved), *files], overrides, registry)
    check_resumable(base, cfg, run_dir)
    return cfg, True


def _saved_for_resume(run_dir: Path | None) -> Path:
    if run_dir is None or not Path(run_dir).is_dir():
        raise ConfigError([("--resume", f"{run_dir} does not exist or is not a directory")])
    saved = Path(run_dir) / SAVED_CONFIG
    if saved.is_file():  # a config but no checkpoint yet: resuming starts it again with that config
        return saved
    if any(Path(run_dir).iterdir()):  # a run that was stopped before it could write its config
        raise ConfigError([("--resume", f"{run_dir} holds no {SAVED_CONFIG}: the run there stopped before "
                                        "it wrote its config, so it never trained and there is nothing to resume. "
                                        f"Start it again with `grpoctl run [-c ...] --run-dir {run_dir}`")])
    raise ConfigError([("--resume", f"{run_dir} is not a run directory (it is empty)")])


@attrs.frozen(kw_only=True)
class OpenedRun:
    """A locked run directory, ready for the trainer (or finished already)."""

    run_dir: Path
    resume: bool  # the directory holds checkpoints: the trainer continues from the latest
    locks: list[RunLock]  # the run directory's, and the checkpoint directory's when it is elsewhere
    finished: str | None  # "already finished" message: there is nothing to train

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def open_run(cfg: MasterConfig, run_dir: Path, *, resume: bool) -> OpenedRun:
    """Check the storage, lock the run directory, and say whether there is anything to do."""
    from grpo_sdk.trainer.checkpoint import CheckpointManager

    manager = CheckpointManager(cfg.checkpointing, run_dir)
    check_storage(run_dir, manager.directory if cfg.checkpointing.enabled else None)
    locks = [RunLock(run_dir).acquire()]  # before anything reads or writes the run dir
    try:
        if cfg.checkpointing.enabled and manager.directory.resolve().parent != run_dir.resolve():
            locks.append(RunLock(manager.directory).acquire())  # shared by several run dirs: guard it too
        resume = resume or manager.latest() is not None
        finished = _finished_message(manager, cfg) if resume else None
        if finished:
            manager.remove_partial()  # a kill while the last save pruned may have left a half-deleted one
        elif (run_dir / "metrics.jsonl").exists() and not resume:
            raise ConfigError([("--run-dir", f"{run_dir} already holds a run without a checkpoint (metrics.jsonl); "
                                             "choose another directory, or restart it with --resume")])
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return OpenedRun(run_dir=run_dir, resume=resume, locks=locks, finished=finished)


def _finished_message(manager: Any, cfg: MasterConfig) -> str | None:
    """Torch-free: "already finished" when the latest checkpoint is at max_num_steps and verifies."""
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


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Third-party progress bars off for the run, back to what they were afterwards."""
    restore: list[Callable[[], None]] = []
    try:
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore.append(hf_logging.enable_progress_bar)
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        if not are_progress_bars_disabled():
            disable_progress_bars()
            restore.append(enable_progress_bars)
    except ImportError:
        pass
    try:
        import datasets

        if datasets.is_progress_bar_enabled():
            datasets.disable_progress_bars()
            restore.append(datasets.enable_progress_bars)
    except (ImportError, AttributeError):
        pass
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


def epoch_limit(cfg: MasterConfig, prompts: Any) -> int | None:
    """The step at which a single dataset's epochs run out, when that is before grpo.max_num_steps."""
    grpo = cfg.grpo
    size = len(getattr(prompts, "prompts", None) or [])
    if not size or grpo.use_dynamic_sampling:  # environment prompts never run out; dynamic sampling draws more
        return None
    steps = -(-grpo.max_num_epochs * size // grpo.num_prompts_per_step)  # the step that completes the last pass
    return steps if steps < grpo.max_num_steps else None


def epoch_note(cfg: MasterConfig, prompts: Any) -> str | None:
    steps = epoch_limit(cfg, prompts)
    if steps is None:
        return None
    grpo, size = cfg.grpo, len(prompts.prompts)
    needed = -(-grpo.max_num_steps * grpo.num_prompts_per_step // size)
    return (f"the dataset has {size} prompts: {grpo.max_num_epochs} epoch(s) at {grpo.num_prompts_per_step} prompts "
            f"per step end the run after step {steps}, not the {grpo.max_num_steps} of grpo.max_num_steps; "
            f"grpo.max_num_epochs={needed} trains them all")


def run_trainer(cfg: MasterConfig, opened: OpenedRun, registry: Any, *, on_setup: Callable[[Any], None] | None = None,
                on_step: Callable[[int, dict[str, float]], None] | None = None) -> Any:
    """Build the trainer in an opened run directory, train, shut down; the RunSummary.

    ``on_setup(trainer)`` runs once the components are built (the CLI prints the resume step and the
    epochs note there). The run directory's lock is released at the end, whatever happens."""
    try:
        with quiet_progress_bars():
            from grpo_sdk.trainer.trainer import GRPOTrainer  # imports torch

            trainer = GRPOTrainer(cfg, run_dir=opened.run_dir, registry=registry, resume=opened.resume)
            try:  # a failed setup must free what it started too (Ray actors, placement groups)
                trainer.setup()
                if on_setup is not None:
                    on_setup(trainer)
                return trainer.train(on_step=on_step)
            finally:
                trainer.shutdown()
    finally:
        opened.release()
