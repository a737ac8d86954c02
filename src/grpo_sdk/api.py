"""The Python API: the run `grpoctl run` does, from a notebook or a script.

    import grpo_sdk

    summary = grpo_sdk.train("recipe.yaml", overrides=["grpo.max_num_steps=50"], reward_funcs=[my_reward])
    config = grpo_sdk.load_config("recipe.yaml", overrides=["grpo.seed=3"])   # structured, validated
    trainer = grpo_sdk.Trainer(config, run_dir="runs/x")
    summary = trainer.train()                                                 # the same run as grpoctl run

Everything goes through ``grpo_sdk.trainer.launch``, as the CLI does: the same run directory
(config.resolved.yaml, metrics.jsonl, checkpoints, summary.json), the same resume (a run directory
that holds checkpoints continues from the latest, and refuses a config that differs in more than
the resumable keys), the same checks. Errors are raised as ``grpo_sdk.GrpoSdkError`` subclasses
(``ConfigError``, ``DataError``, ``PluginError``...) instead of ending the process; nothing is
printed but warnings, unless ``progress=True``; a stop signal (Ctrl-C, the notebook's interrupt)
finishes the step, saves a checkpoint, and returns a summary with status ``interrupted``.

Importing this module imports no torch: the trainer is imported when a run starts.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from grpo_sdk.config.schema import MasterConfig
from grpo_sdk.core.errors import ConfigError
from grpo_sdk.core.records import RunStatus, RunSummary

log = logging.getLogger(__name__)

ConfigFiles = str | os.PathLike | Sequence[str | os.PathLike] | None
RewardFunction = Callable[..., Any]
StepCallback = Callable[[int, dict[str, float]], None]


def _registry(plugins: Sequence[str]) -> Any:
    """The registry of installed plugins, plus hook plugin modules imported by name (``-p``)."""
    from grpo_sdk.plugins.host import PluginHost, import_plugin_module
    from grpo_sdk.plugins.registry import Registry

    host = PluginHost()
    host.load_entry_points()
    for module in plugins:
        import_plugin_module(module)
        host.load_module(module)
    return Registry.discover(host=host)


def _files(config: ConfigFiles) -> list[str]:
    if config is None:
        return []
    if isinstance(config, (str, os.PathLike)):
        return [os.fspath(config)]
    return [os.fspath(c) for c in config]


def _reward_overrides(reward_funcs: Sequence[RewardFunction | str] | None) -> list[str]:
    """``reward_funcs`` as config: the reward_functions environment, scoring with these functions."""
    if not reward_funcs:
        return []
    from grpo_sdk.environments.callables import reference_for

    refs = [fn if isinstance(fn, str) else reference_for(fn) for fn in reward_funcs]
    quoted = ", ".join('"' + ref.replace("\\", "\\\\").replace('"', '\\"') + '"' for ref in refs)
    return ["env.name=reward_functions", f"env.reward_functions.functions=[{quoted}]"]


def load_config(config: ConfigFiles = None, overrides: Sequence[str] = (), *,
                reward_funcs: Sequence[RewardFunction | str] | None = None,
                plugins: Sequence[str] = ()) -> MasterConfig:
    """The structured, validated config of YAML file(s) (None: the built-in recipe) and dotted overrides,
    as `grpoctl config show` resolves it. Raises ConfigError listing every problem."""
    from grpo_sdk.config.loading import load_config as load

    return load(_files(config), [*_reward_overrides(reward_funcs), *overrides], _registry(plugins))


class Trainer:
    """One run in one run directory: ``Trainer(config, run_dir=...).train()`` is `grpoctl run --run-dir`.

    ``config`` is a MasterConfig from ``load_config``, or YAML file(s) (None: the built-in recipe)
    resolved with ``overrides`` exactly as `grpoctl run -c FILE OVERRIDES` resolves them: in a run
    directory that holds checkpoints the saved config is the base (see ``grpo_sdk.trainer.launch``).
    ``reward_funcs``: score with these functions (``fn(prompts, completions, **columns)``, or
    "module:function" names) through the ``reward_functions`` environment.
    """

    def __init__(self, config: MasterConfig | ConfigFiles = None, *, run_dir: str | os.PathLike | None = None,
                 overrides: Sequence[str] = (), reward_funcs: Sequence[RewardFunction | str] | None = None,
                 plugins: Sequence[str] = (), resume: bool = False, progress: bool = False,
                 on_step: StepCallback | None = None):
        from grpo_sdk.trainer.launch import check_resumable, default_run_dir, resolve_config, saved_config_of

        self.registry = _registry(plugins)
        run_path = Path(run_dir) if run_dir is not None else None
        extra = [*_reward_overrides(reward_funcs), *overrides]
        if isinstance(config, MasterConfig):
            if extra:
                raise ConfigError([("overrides", "give overrides and reward_funcs to load_config, not with a "
                                                 "config that is already loaded")])
            self.resuming = resume or saved_config_of(run_path) is not None
            if self.resuming and (saved := saved_config_of(run_path)) is not None:
                from grpo_sdk.config.loading import load_config as load

                check_resumable(load([str(saved)], [], self.registry), config, run_path)
            self.config = config
        else:
            self.config, self.resuming = resolve_config(_files(config), extra, run_path, self.registry, resume=resume)
        self.run_dir = run_path or default_run_dir(self.config)
        self.progress = progress
        self.on_step = on_step
        self.summary: RunSummary | None = None

    def train(self) -> RunSummary:
        """Train to the end (or resume to it); the summary, also in ``<run_dir>/summary.json``."""
        from grpo_sdk.trainer.launch import open_run, run_trainer

        opened = open_run(self.config, self.run_dir, resume=self.resuming)
        if opened.finished:
            opened.release()
            self.summary = _finished_summary(self.run_dir, opened.finished)
            return self.summary
        start = time.perf_counter()

        def on_step(step: int, metrics: dict[str, float]) -> None:
            if self.progress:
                print(f"step {step}/{self.config.grpo.max_num_steps}  reward {metrics['reward/mean']:.3f}  "
                      f"elapsed {time.perf_counter() - start:.1f}s", file=sys.stdout, flush=True)
            if self.on_step is not None:
                self.on_step(step, metrics)

        def on_setup(trainer: Any) -> None:
            from grpo_sdk.trainer.launch import epoch_note

            if note := epoch_note(self.config, trainer.components.prompts):
                log.warning("grpo-sdk: %s", note)  # a warning, not a print: it says the run ends early

        self.summary = run_trainer(self.config, opened, self.registry, on_setup=on_setup, on_step=on_step)
        return self.summary


def _finished_summary(run_dir: Path, message: str) -> RunSummary:
    """A finished run's summary.json, as ``already_finished``; the message when there is none."""
    import json

    import attrs

    try:
        saved = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        fields = {f.name for f in attrs.fields(RunSummary)}
        summary = RunSummary(**{k: v for k, v in saved.items() if k in fields})
        return attrs.evolve(summary, status=RunStatus.ALREADY_FINISHED, run_dir=Path(summary.run_dir), seconds=0.0,
                            checkpoint=Path(summary.checkpoint) if summary.checkpoint else None)
    except (OSError, ValueError, TypeError):
        raise ConfigError([("run_dir", message)]) from None


def train(config: MasterConfig | ConfigFiles = None, overrides: Sequence[str] = (), *,
          run_dir: str | os.PathLike | None = None, reward_funcs: Sequence[RewardFunction | str] | None = None,
          plugins: Sequence[str] = (), resume: bool = False, progress: bool = False,
          on_step: StepCallback | None = None) -> RunSummary:
    """Train as `grpoctl run -c CONFIG OVERRIDES --run-dir RUN_DIR` does; the RunSummary (status,
    steps, rewards, the last step's ``metrics``, validation, the checkpoint). See ``Trainer``."""
    return Trainer(config, run_dir=run_dir, overrides=overrides, reward_funcs=reward_funcs, plugins=plugins,
                   resume=resume, progress=progress, on_step=on_step).train()


def export_model(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
                 best: bool = False, lora: str = "merged") -> Path:
    """`grpoctl export`: a checkpoint's policy as a standalone Hugging Face model directory; its path.
    A LoRA checkpoint: ``lora="merged"`` folds the adapters into the base, ``"adapter"`` copies peft's
    adapter directory."""
    from grpo_sdk.trainer.checkpoint import export_policy

    return export_policy(Path(run_dir), Path(out), step=step, best=best, lora=lora)
