"""The synchronous GRPO training run, top to bottom. It talks to the components only through the
protocols of ``grpo_sdk.core.protocols``; nothing here knows which backend it drives.

One step::

    prompts  = next P prompts                       (dataset or environment)
    batch    = G responses per prompt, scored       (Generation, Environment)
    batch.prev_logprobs      = policy.logprobs      (only when a step takes several optimizer steps)
    batch.reference_logprobs = policy.reference_logprobs    (only when the KL penalty is on)
    batch.advantages = estimator.compute_advantages(batch.advantage_input())
    metrics  = policy.train(batch, loss_fn)         (Policy)
    weight_sync.sync_weights(policy, generation, version=step)

The run around it: validation, periodic checkpoints, exact resume, stop signals (the first one
finishes the step and saves), the save-by deadline, early stop and the summary.

Exact resume: a checkpoint holds everything that decides what happens next (weights, optimizer and
LR schedule, the sampler's RNG, torch's RNG as a file, and ``TrainerState``: the step and group-id
counters, Python's RNG, the dataloader position, the reward history), so a run killed at any moment
and resumed from its latest checkpoint logs the same metrics and ends with bit-identical weights as
a run never interrupted (CPU, one thread). Metrics logged after the checkpoint are dropped on resume
and logged again. See docs/lifecycle.md and docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from grpo_sdk.algorithms.loss import ClippedPGLoss
from grpo_sdk.algorithms.rewards import clip_advantages, mask_by_seq_logprob_error, seq_logprob_errors
from grpo_sdk.algorithms.sampling import validation_sampling
from grpo_sdk.core.capabilities import Capability
from grpo_sdk.config.schema import MasterConfig, plugin_config
from grpo_sdk.config.checks.lifecycle import parse_duration
from grpo_sdk.config.loading import to_yaml
from grpo_sdk.config.context import RunContext
from grpo_sdk.core.errors import GrpoSdkError, NonFiniteError
from grpo_sdk.core.machine import pick_device
from grpo_sdk.core.models import load_tokenizer, resolve_model_source
from grpo_sdk.core.protocols import Checkpointable, ReportsMetrics, SupportsShutdown
from grpo_sdk.core.records import RunStatus, RunSummary, SamplingParams, TrainBatch
from grpo_sdk.data.prompt_sources import make_prompt_source, make_validation_prompts
from grpo_sdk.rollouts.async_rollouts import AsyncRollouts
from grpo_sdk.rollouts.collector import rewind_to_cut
from grpo_sdk.rollouts.episodes import episode_metrics, override_turn_advantages
from grpo_sdk.rollouts.rollout import RolloutBatch, collect_rollouts, example_of
from grpo_sdk.rollouts.step_rollouts import StepRollouts
from grpo_sdk.runtime import make_runtime
from grpo_sdk.runtime.allocator import release_freed_memory, while_training
from grpo_sdk.trainer.checkpoint import STATE_FILE, CheckpointManager, ranking_metric
from grpo_sdk.trainer.run_dir import RunLock, check_storage, checkpoint_bytes, initial_model_path, write_text_atomic
from grpo_sdk.trainer.signals import STOP, signal_name
from grpo_sdk.trainer.state import Components, TrainerState

VALIDATION_SEED_OFFSET = 7_919  # validation's sampling seed is grpo.seed + this + step


class GRPOTrainer:
    """Builds the components of a run and trains; observer hooks get this object as ``run``."""

    def __init__(self, config: MasterConfig, *, run_dir: str | Path, registry: Any, resume: bool = False):
        self.config = config
        self.run_dir = Path(run_dir)
        self.registry = registry
        self.resume = resume  # continue from the latest checkpoint in run_dir, if there is one
        self.state = TrainerState()
        self.checkpoints = CheckpointManager(config.checkpointing, self.run_dir)
        self.components: Components | None = None  # set by setup()
        self.locks: list[RunLock] = []
        self.opened: list[Any] = []  # what shutdown() must close, in the order it was built
        self.last_batch: TrainBatch | None = None  # the last step's, for the summary's example
        self.last_saved_step: int | None = None
        self.validated_step: int | None = None
        self.last_metrics: dict[str, float] = {}  # the last logged step's, for the summary
        self.async_rollouts: AsyncRollouts | None = None  # grpo.async_grpo.enabled: the collector and buffer
        self.restored_from: Path | None = None  # the checkpoint setup resumed from

    @property
    def step(self) -> int:
        return self.state.step

    # --- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.config
        if cfg.cluster.num_threads:
            torch.set_num_threads(cfg.cluster.num_threads)
        random.seed(cfg.grpo.seed)
        torch.manual_seed(cfg.grpo.seed)
        model_path = self._prepare_run_dir()
        latest = self.checkpoints.latest_verified(warn=lambda m: print(m, file=sys.stderr, flush=True)) \
            if self.resume else None
        if cfg.checkpointing.enabled:  # room for one checkpoint, before hours of training make one
            check_storage(self.run_dir, self.checkpoints.directory, checkpoint_bytes(model_path, cfg))
        # The tokenizer first: every component gets its EOS and pad ids in the context.
        tokenizer_key = "policy.tokenizer.name" if cfg.policy.tokenizer.name else "policy.model_name"
        tokenizer_path = resolve_model_source(cfg.policy.tokenizer.name, tokenizer_key) \
            if cfg.policy.tokenizer.name else model_path  # a GGUF file's tokenizer: its cached directory's
        tokenizer = load_tokenizer(tokenizer_path, key=tokenizer_key)
        context = RunContext(
            resume_step=(int(latest.name.split("_")[1]) if latest else 0) if self.resume else None,
            config=cfg, run_dir=self.run_dir, model_path=model_path,  # made absolute by RunContext
            tokenizer_path=tokenizer_path,
            # On Ray each worker picks its own device; the driver may have none.
            device=pick_device(cfg.cluster.device) if cfg.cluster.runtime == "local" else cfg.cluster.device,
            seed=cfg.grpo.seed, needs_reference=cfg.loss_fn.reference_policy_kl_penalty > 0,
            registry=self.registry, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        runtime = self._open(make_runtime(cfg, self.registry))
        STOP.reinstall()  # ray.init installs a SIGTERM handler of its own

        def build(kind: str, section: Any, name: str | None = None) -> Any:
            name = name or getattr(section, type(section).__plugin__.selector)
            return self._open(runtime.build(kind, name, plugin_config(section, name), context))

        policy = build("policy", cfg.policy)
        generation = build("generation", cfg.policy.generation)
        environment = build("environment", cfg.env)
        estimator = build("estimator", cfg.grpo.adv_estimator)
        weight_sync = build("weight_sync", cfg.weight_sync)
        # What the step needs beyond rewards follows from the config and the estimator's declared
        # capabilities, never from its name.
        needs = self.registry.get("estimator", cfg.grpo.adv_estimator.name).capabilities
        teacher = self._open(self._build_teacher(runtime, context)) if Capability.TEACHER_LOGPROBS in needs else None
        gen = cfg.policy.generation
        max_prompt_tokens = cfg.data.max_input_seq_length or (cfg.policy.max_total_sequence_length - gen.max_new_tokens)
        in_loss_threshold = cfg.grpo.seq_logprob_error_threshold if cfg.loss_fn.seq_logprob_error_in_loss else None
        rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        prompts = make_prompt_source(cfg, environment, tokenizer, max_prompt_tokens)
        sampling = SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                                  top_k=gen.top_k, stop_token_ids=tuple(gen.stop_token_ids))
        self.components = Components(
            context=context, runtime=runtime, policy=policy, generation=generation, environment=environment,
            estimator=estimator, weight_sync=weight_sync, teacher=teacher, tokenizer=tokenizer,
            loss_fn=ClippedPGLoss(cfg.loss_fn, seq_logprob_error_threshold=in_loss_threshold),
            prompts=prompts,
            step_rollouts=StepRollouts(cfg, prompts=prompts, tokenizer=tokenizer, generation=generation,
                                       environment=environment, sampling=sampling,
                                       max_prompt_tokens=max_prompt_tokens),
            val_prompts=make_validation_prompts(cfg, environment, tokenizer, max_prompt_tokens),
            sampling=sampling,
            max_prompt_tokens=max_prompt_tokens,
            needs_prev_logprobs=(
                (cfg.policy.train_global_batch_size or rows) < rows  # several optimizer steps: freeze "old"
                or "prev_logprobs" in needs
                or (cfg.loss_fn.use_kl_in_reward and cfg.loss_fn.reference_policy_kl_penalty > 0)
                or (cfg.grpo.seq_logprob_error_threshold is not None and not cfg.loss_fn.seq_logprob_error_in_loss)),
        )
        if latest is not None:
            self._restore(latest)
        # Loggers last: one that opens a remote run (W&B, MLflow) must not be left open by a failed setup.
        loggers = [build("logger", cfg.logger, name) for name in cfg.logger.loggers]
        self.components = attrs.evolve(self.components, loggers=loggers)

    def _prepare_run_dir(self) -> str:
        """Lock the run directory, write the resolved config and plugin versions, and return the
        model path (a built-in model is built into the run directory)."""
        cfg = self.config
        check_storage(self.run_dir, self.checkpoints.directory if cfg.checkpointing.enabled else None)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.locks.append(RunLock(self.run_dir).acquire())
        if cfg.checkpointing.enabled and self.checkpoints.directory.resolve().parent != self.run_dir.resolve():
            self.locks.append(RunLock(self.checkpoints.directory).acquire())  # shared elsewhere: guard it too
        try:  # disk full or a vanished mount before the first step: a clear error, not a traceback
            write_text_atomic(self.run_dir / "config.resolved.yaml", to_yaml(cfg))
            write_text_atomic(self.run_dir / "plugins.json", json.dumps(self._plugin_versions(), indent=2) + "\n")
            self.checkpoints.remove_partial()
            return initial_model_path(cfg.policy.model_name, self.run_dir, cfg.grpo.seed)
        except (OSError, SafetensorError) as exc:  # safetensors reports ENOSPC as its own error type
            detail = f"{exc.strerror} ({exc.filename or self.run_dir})" if isinstance(exc, OSError) else str(exc)
            raise GrpoSdkError(f"could not write to the run directory {self.run_dir}: {detail}") from exc

    def _build_teacher(self, runtime: Any, context: RunContext) -> Any:
        """The on-policy-distillation teacher: any policy backend, loaded from a model or checkpoint dir."""
        opd = self.config.on_policy_distillation
        precision = opd.teacher_precision or self.config.policy.precision
        config = attrs.evolve(self.config, policy=attrs.evolve(self.config.policy, precision=precision))
        teacher = resolve_model_source(opd.teacher_model, "on_policy_distillation.teacher_model")  # a GGUF file: its directory
        context = attrs.evolve(context, config=config, model_path=teacher, needs_reference=False)
        return runtime.build("policy", opd.teacher_backend, None, context)

    def _open(self, component: Any) -> Any:
        self.opened.append(component)
        return component

    def _plugin_versions(self) -> dict[str, Any]:
        from grpo_sdk import __version__

        return {"grpo_sdk": __version__, "torch": torch.__version__,
                "components": [info.to_json() for info in self.registry.list()],
                "hooks": [p.to_json() for p in self.registry.hook_plugins]}

    # --- the run --------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The run reached its end (also: a resumed run with nothing left to do)."""
        grpo = self.config.grpo
        return self.state.step >= grpo.max_num_steps or self.data_epoch >= grpo.max_num_epochs

    @property
    def data_epoch(self) -> int:
        """Completed passes over the data as far as training went (async: the collector draws ahead,
        so it is the epoch recorded with the last trained target)."""
        if self.config.grpo.async_grpo.enabled:
            return int(self.state.rollouts.get("epoch", 0))
        return self.components.prompts.epoch

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> RunSummary:
        """Train to the end (steps, epochs, early stop, deadline or a stop signal); write and return
        the summary. ``on_step(step, metrics)`` is called after each step is logged."""
        start = time.perf_counter()
        if self.finished:  # resuming a finished run: nothing to log, nothing to save again
            return self._summary(RunStatus.ALREADY_FINISHED, start)
        hooks = self.registry.host
        own_handlers = not STOP.installed and STOP.install()  # a library caller gets the same signal handling
        if own_handlers:
            STOP.reset()
        status, error = RunStatus.FAILED, None
        hooks.run_start(run=self)
        try:
            STOP.deferred = True  # from here a first stop signal waits for the end of the step
            # A signal that came while the run started (and was swallowed there): no step, no save.
            status = RunStatus.INTERRUPTED if STOP.requested else self._train_until_stopped(start, on_step)
        except BaseException as exc:
            status, error = (RunStatus.INTERRUPTED if isinstance(exc, KeyboardInterrupt) else RunStatus.FAILED), exc
            if isinstance(exc, KeyboardInterrupt):  # stopped at once: say so in summary.json, then stop
                self._summary(status, start)
            raise
        finally:
            STOP.deferred = False
            if own_handlers:
                STOP.uninstall()
            for logger in self.components.loggers:
                logger.close()
            hooks.run_end(run=self, status=status, error=error)
        return self._summary(status, start)

    def _train_until_stopped(self, start: float, on_step: Callable[[int, dict[str, float]], None] | None) -> RunStatus:
        grpo, ckpt = self.config.grpo, self.config.checkpointing
        deadline = parse_duration(ckpt.checkpoint_must_save_by) if ckpt.checkpoint_must_save_by else None
        if grpo.val_at_start and self.state.step == 0 and self.components.val_prompts:
            self._log(0, self._validation_metrics(0))
        if grpo.async_grpo.enabled:  # after the first validation: that one has the engine to itself
            self.async_rollouts = self._open(AsyncRollouts(self.config, self.components.step_rollouts, self.state,
                                                           self.components.runtime))
            self.async_rollouts.start(self.state.step, self.restored_from)
        metrics: dict[str, float] = {}
        slowest_step = 0.0
        while not self.finished:
            tick = time.perf_counter()
            try:
                metrics, self.last_batch = self.train_step()
            except NonFiniteError as exc:
                raise NonFiniteError(f"step {self.state.step + 1}: {exc}") from exc
            self.state.step += 1
            if self.config.cluster.release_freed_memory:
                release_freed_memory()
            self.state.record_reward(metrics["reward/mean"])
            step = self.state.step
            periodic = grpo.val_period > 0 and step >= grpo.val_start_at and step % grpo.val_period == 0
            last = step >= grpo.max_num_steps
            validated = bool(self.components.val_prompts) and (periodic or (grpo.val_at_end and last))
            if validated:
                with self._engine_to_ourselves("validation"):
                    metrics.update(self._validation_metrics(step))
            self._log(step, metrics)
            self.last_metrics = dict(metrics)
            self.registry.host.step_end(run=self, step=step, metrics=metrics)
            if on_step is not None:
                on_step(step, metrics)
            slowest_step = max(slowest_step, time.perf_counter() - tick)
            early = validated and reached(grpo, self.state.validation)
            late = deadline is not None and time.perf_counter() - start + 2 * slowest_step > deadline
            # A failed collector ends the run, but the step it overlapped trained: keep it.
            failed = self.async_rollouts is not None and self.async_rollouts.failed
            if step % ckpt.save_period == 0 or early or late or STOP.requested or failed:
                self._save(metrics)
            if failed:
                self.async_rollouts.check()
            # Asked after the save too: a signal that lands while it writes stops the run at this step.
            if STOP.requested or early or late:
                return RunStatus.INTERRUPTED if STOP.requested else RunStatus.EARLY_STOP if early \
                    else RunStatus.DEADLINE
            if self.async_rollouts is not None and not self.finished:
                self.async_rollouts.after_step(step)  # validated and saved: the next target may start
        if grpo.val_at_end and self.components.val_prompts and self.state.step \
                and self.validated_step != self.state.step:  # the run ended by epochs, not steps
            with self._engine_to_ourselves("validation"):
                validation = self._validation_metrics(self.state.step)
            self._log(self.state.step, validation)
            self.last_metrics.update(validation)
        self._save(metrics)
        return RunStatus.COMPLETED

    def _engine_to_ourselves(self, what: str) -> Any:
        """Async GRPO: the collector generates nothing while the trainer uses the engine."""
        return self.async_rollouts.paused(what) if self.async_rollouts is not None else contextlib.nullcontext()

    # --- one step -------------------------------------------------------------------------------

    def train_step(self) -> tuple[dict[str, float], TrainBatch]:
        """One GRPO step; its metrics and its step record (the batch the policy trained on)."""
        cfg, parts = self.config, self.components
        timings: dict[str, float] = {}
        start = time.perf_counter()
        if self.async_rollouts is not None:
            rollouts, metrics, timings["exposed_generation"] = self.async_rollouts.batch_for(self.state.step)
            generation_seconds = metrics["timing/collector/generation"]
        else:
            rollouts, metrics = self.collect_rollouts()
            timings["rollout"] = generation_seconds = time.perf_counter() - start

        sample_mask = rollouts.reward_valid.float()
        if cfg.grpo.overlong_filtering:  # out of the loss, still in the baseline
            sample_mask = sample_mask * (~rollouts.truncated).float()
        batch = rollouts.to_train_batch(sample_mask)

        # One span of training memory (cluster.malloc_mmap_threshold) from the logprobs to the optimizer step.
        with while_training(cfg.cluster.malloc_mmap_threshold):
            tick = time.perf_counter()
            self._logprobs(batch)
            timings["logprobs"] = time.perf_counter() - tick
            metrics.update(self._advantages(batch))
            tick = time.perf_counter()
            metrics.update(parts.policy.train(batch, parts.loss_fn))
            timings["train"] = time.perf_counter() - tick
        if cfg.logger.dump_train_data:
            dump_batch(self.run_dir / "train_data" / f"step_{self.state.step + 1}.jsonl", batch)

        if self.async_rollouts is not None:  # the engine holds one version: let the collector finish first
            timings["refit_bubble"], metrics["train/buffer_size"] = self.async_rollouts.before_weight_sync()
        tick = time.perf_counter()
        parts.weight_sync.sync_weights(parts.policy, parts.generation, version=self.state.step + 1)
        timings["weight_sync"] = time.perf_counter() - tick
        if self.async_rollouts is not None:
            self.async_rollouts.after_weight_sync(self.state.step + 1)
        timings["step"] = time.perf_counter() - start
        metrics.update({f"timing/{k}": v for k, v in timings.items()})
        metrics["perf/tokens_per_sec"] = metrics["generated_tokens"] / timings["step"]
        metrics["perf/rollout_tokens_per_sec"] = metrics["generated_tokens"] / generation_seconds
        return metrics, batch

    def collect_rollouts(self) -> tuple[RolloutBatch, dict[str, float]]:
        """Rollouts for the next step, through the reward pipeline (``StepRollouts``)."""
        return self.components.step_rollouts.collect(self.state.step + 1, self.state)

    def _logprobs(self, batch: TrainBatch) -> None:
        """The logprobs the step needs beyond the generation's: the old policy's, the reference's and
        the teacher's, each only when something reads it (``Components.needs_prev_logprobs``)."""
        parts = self.components
        if parts.needs_prev_logprobs:
            batch.prev_logprobs = parts.policy.logprobs(batch)
        if parts.context.needs_reference:
            batch.reference_logprobs = parts.policy.reference_logprobs(batch)
        if parts.teacher is not None:
            batch.teacher_logprobs = parts.teacher.logprobs(batch)

    def _advantages(self, batch: TrainBatch) -> dict[str, float]:
        """Mask samples whose logprobs disagree (when asked), then fill ``batch.advantages``: the
        estimator's, clipped, with the flagged turns' overrides. Returns the metrics of it."""
        cfg, parts, metrics = self.config, self.components, {}
        if batch.prev_logprobs is not None and not cfg.loss_fn.seq_logprob_error_in_loss:
            errors, valid = seq_logprob_errors(batch.prev_logprobs, batch.generation_logprobs, batch.token_mask,
                                               batch.sample_mask)
            batch.sample_mask, seq_metrics = mask_by_seq_logprob_error(
                errors, valid, batch.sample_mask, batch.rewards, cfg.grpo.seq_logprob_error_threshold)
            metrics.update(seq_metrics)
        advantages = parts.estimator.compute_advantages(batch.advantage_input())
        batch.advantages, override_metrics = override_turn_advantages(
            clip_advantages(advantages, cfg.grpo.advantage_clip_low, cfg.grpo.advantage_clip_high), batch, cfg.grpo)
        metrics.update(override_metrics)
        if isinstance(parts.estimator, ReportsMetrics):
            metrics.update(parts.estimator.last_metrics)
        response_advantages = batch.advantages[batch.loss_mask > 0]
        if response_advantages.numel():
            metrics.update({"advantages/mean": float(response_advantages.mean()),
                            "advantages/min": float(response_advantages.min()),
                            "advantages/max": float(response_advantages.max())})
        return metrics

    # --- validation -----------------------------------------------------------------------------

    def validate(self, step: int) -> tuple[dict[str, float], list[RolloutBatch]]:
        """Sample the validation prompts with the current policy and score them.

        Validation samples from a fixed seed (grpo.seed + VALIDATION_SEED_OFFSET + step), so it never
        perturbs the training sampler's random stream and the same weights always give the same
        numbers. Rewards are the environment's raw rewards (no scaling or shaping). Metrics, logged as
        ``val/<name>``: ``accuracy`` (mean reward), ``pass_k`` (k = grpo.val_num_generations_per_prompt
        > 1: the fraction of prompts with a sample whose reward is >= 1, fully correct; NeMo-RL
        counted any reward > 0), ``avg_length`` (the model's tokens), ``num_samples``, multi-turn the
        episode metrics (``episode/turns_mean``...), and the environment's own metrics.
        """
        cfg, parts = self.config, self.components
        k, size = cfg.grpo.val_num_generations_per_prompt, cfg.grpo.val_batch_size
        sampling = validation_sampling(parts.sampling, cfg.policy.generation,
                                       seed=cfg.grpo.seed + VALIDATION_SEED_OFFSET + step)
        batches, env_metrics = [], []
        for start in range(0, len(parts.val_prompts), size):
            batch, metrics = collect_rollouts(
                prompts=parts.val_prompts[start:start + size], tokenizer=parts.tokenizer,
                generation=parts.generation, environment=parts.environment, cfg=cfg, sampling=sampling,
                max_prompt_tokens=parts.max_prompt_tokens, group_offset=start, num_generations=k)
            batch.rewards = torch.stack(list(batch.reward_components.values())).sum(0)  # raw: no scaling, no shaping
            batches.append(batch)
            env_metrics.append(metrics)
        rewards = torch.cat([b.rewards for b in batches])
        valid = torch.cat([b.reward_valid for b in batches])
        lengths = torch.cat([b.generated_lengths for b in batches]).float()
        out = {"accuracy": float(rewards[valid].mean()) if valid.any() else float("nan"),
               "avg_length": float(lengths.mean()), "num_samples": float(len(rewards))}
        if cfg.grpo.max_rollout_turns > 1:  # turns per episode, and the flag rates, as in training
            out.update(episode_metrics([log for b in batches for log in b.message_logs]))
        if k > 1:
            out["pass_k"] = float(((rewards >= 1.0) & valid).view(-1, k).any(dim=1).float().mean())
        for key in env_metrics[0]:
            out[key.removeprefix("env/")] = sum(m[key] for m in env_metrics) / len(env_metrics)
        return out, batches

    def _validation_metrics(self, step: int) -> dict[str, float]:
        metrics, batches = self.validate(step)
        self.state.validation, self.validated_step = metrics, step
        if self.config.logger.dump_train_data:
            dump_rollouts(self.run_dir / "train_data" / f"val_step_{step}.jsonl", RolloutBatch.concat(batches))
        return {f"val/{k}": v for k, v in metrics.items()}

    # --- metrics, checkpoints, summary ----------------------------------------------------------

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        for logger in self.components.loggers:
            try:
                logger.log_metrics(step, metrics)
            except OSError as exc:  # disk full, a vanished mount: name the file, keep the last checkpoint
                raise GrpoSdkError(f"could not write the metrics of step {step}: {exc}; the latest checkpoint "
                                   f"({self.checkpoints.latest()}) is intact, resume from it once the storage is "
                                   "fixed") from exc

    def _save(self, train_metrics: dict[str, float]) -> Path | None:
        if not self.config.checkpointing.enabled or self.last_saved_step == self.state.step:
            return None
        self.state.ranking_metric = ranking_metric(self.config.checkpointing.metric_name, train_metrics,
                                                   self.state.validation)
        version, internal, gauss = random.getstate()
        self.state.python_random = [version, list(internal), gauss]
        if self.async_rollouts is None:
            self.state.data = self.components.prompts.state_dict()
            state = self.state.to_json()
        else:  # the collector may be drawing: save where a resume draws next, from one snapshot
            self.state.rollouts = self.async_rollouts.checkpoint_state(self.state.step)
            resume = self.state.rollouts["resume"]
            state = {**self.state.to_json(), "data": resume["data"], "next_group_id": resume["next_group_id"],
                     "reward_failures": resume["reward_failures"]}
        path = self.checkpoints.save(self.state.step, self._write_checkpoint, state)
        self.last_saved_step = self.state.step
        self.registry.host.checkpoint_saved(run=self, step=self.state.step, path=str(path))
        return path

    def _write_checkpoint(self, directory: Path) -> None:
        parts, directory = self.components, directory.absolute()  # components get absolute paths
        parts.policy.save_checkpoint(str(directory / "policy"))
        parts.tokenizer.save_pretrained(str(directory / "policy"))  # policy/ is a complete HF model dir
        if isinstance(parts.generation, Checkpointable):
            parts.generation.save_checkpoint(str(directory / "generation"))
        save_file({"torch": torch.get_rng_state()}, str(directory / "rng.safetensors"))
        if self.async_rollouts is not None:
            self.async_rollouts.write(directory)

    def _restore(self, directory: Path) -> None:
        parts, directory = self.components, directory.absolute()
        self.state = TrainerState.from_json(json.loads((directory / STATE_FILE).read_text()))
        parts.policy.load_checkpoint(str(directory / "policy"))
        if isinstance(parts.generation, Checkpointable) and (directory / "generation").is_dir():
            parts.generation.load_checkpoint(str(directory / "generation"))
        parts.weight_sync.sync_weights(parts.policy, parts.generation, version=self.state.step)
        torch.set_rng_state(load_file(str(directory / "rng.safetensors"))["torch"])
        version, internal, gauss = self.state.python_random
        random.setstate((version, tuple(internal), gauss))
        parts.prompts.load_state_dict(self.state.data)
        if not self.config.grpo.async_grpo.enabled:  # an async run's checkpoint drew ahead of training
            rewind_to_cut(self.state.rollouts, self.state, parts.prompts)
        self.restored_from = directory
        self.last_saved_step = self.state.step

    def _summary(self, status: RunStatus, start: float) -> RunSummary:
        """The run's summary, also written to ``summary.json`` (atomically; a write error is reported, not raised)."""
        tail = self.state.reward_tail
        summary = RunSummary(
            status=status, steps=self.state.step, seconds=time.perf_counter() - start,
            reward_first=self.state.reward_first if self.state.reward_first is not None else math.nan,
            reward_last=sum(tail) / len(tail) if tail else math.nan, validation=self.state.validation,
            run_dir=self.run_dir, checkpoint=self.checkpoints.latest(), example=example_of(self.last_batch),
            reason=signal_name(STOP.signum) if status == RunStatus.INTERRUPTED and STOP.signum else None,
            metrics=self.last_metrics, ended_by=self._ended_by(status))
        if status != RunStatus.ALREADY_FINISHED:
            try:
                write_text_atomic(self.run_dir / "summary.json", json.dumps(summary.to_json(), indent=2) + "\n")
            except OSError as exc:
                print(f"grpo-sdk: warning: could not write {self.run_dir / 'summary.json'}: {exc}", flush=True)
        return summary

    def _ended_by(self, status: RunStatus) -> str | None:
        grpo = self.config.grpo
        if status == RunStatus.COMPLETED and self.state.step < grpo.max_num_steps \
                and self.data_epoch >= grpo.max_num_epochs:
            return "grpo.max_num_epochs"
        return None

    def shutdown(self) -> None:
        """Close what setup opened, newest first (loggers are closed by ``train``)."""
        from grpo_sdk.rollouts.agent_rollouts import close_endpoints

        try:
            close_endpoints()  # the rollout endpoint before the backend it generates with
            for component in reversed(self.opened):
                if isinstance(component, SupportsShutdown):
                    component.shutdown()
        finally:
            self.opened = []
            for lock in self.locks:
                lock.release()
            self.locks = []


def reached(grpo: Any, validation: dict[str, float]) -> bool:
    """Early stop: the chosen validation metric reached its threshold."""
    name = grpo.stop_at_validation_metric
    return name is not None and validation.get(name, -math.inf) >= grpo.stop_at_validation_threshold


def dump_batch(path: Path, batch: TrainBatch) -> None:
    """One JSON object per sample of a training step, NeMo-RL's train_data_step*.jsonl fields;
    ``content`` holds the whole episode, every turn (with its token count and, where the
    environment set them, its flags)."""
    rows = []
    for i, log in enumerate(batch.message_logs):
        valid = batch.attention_mask[i].bool()
        rows.append({
            **episode_row(log, bool(batch.truncated[i]), float(batch.rewards[i])),
            "input_lengths": int(valid.sum()), "token_ids": batch.input_ids[i][valid].tolist(),
            "token_loss_mask": batch.token_mask[i][valid].tolist(),
            "sample_loss_mask": float(batch.sample_mask[i]),
            "advantages": batch.advantages[i][valid].tolist(),
            "generation_logprobs": batch.generation_logprobs[i][valid].tolist(),
            "prev_logprobs": batch.prev_logprobs[i][valid].tolist() if batch.prev_logprobs is not None else None,
        })
    write_jsonl(path, rows)


def dump_rollouts(path: Path, rollouts: RolloutBatch) -> None:
    """Validation's samples as ``dump_batch`` writes a step's, without the training fields."""
    write_jsonl(path, [episode_row(log, bool(rollouts.truncated[i]), float(rollouts.rewards[i]))
                       for i, log in enumerate(rollouts.message_logs)])


def episode_row(log: Any, truncated: bool, reward: float) -> dict[str, Any]:
    return {"content": [{"role": m.role, "content": m.content, "num_tokens": len(m.token_ids),
                         **({"flags": list(m.flags)} if m.flags else {})} for m in log],
            "truncated": truncated, "rewards": reward}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
