"""The synchronous GRPO training loop. It talks only to the protocols.

One step::

    prompts  = next P prompts                       (dataset or environment)
    batch    = G responses per prompt, scored       (Generation, Environment)
    batch.prev_logprobs      = policy.logprobs      (only when a step takes several optimizer steps)
    batch.reference_logprobs = policy.reference_logprobs    (only when the KL penalty is on)
    batch.advantages = estimator.compute_advantages(rewards, group_ids, mask, ...)
    metrics  = policy.train(batch, loss_fn)         (Policy)
    weight_sync.sync_weights(policy, generation, version=step)

Every component is built the same way, ``registry.load_impl(kind, name)(config_block, context)``;
nothing here knows which backend it drives.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
from safetensors import SafetensorError

from grpo_sdk.algorithms.loss import ClippedPGLoss
from grpo_sdk.algorithms.rewards import (
    clip_advantages,
    mask_by_seq_logprob_error,
    scale_rewards,
    seq_logprob_errors,
    shape_rewards,
    trivial_groups,
)
from grpo_sdk.core.config import MasterConfig, plugin_config
from grpo_sdk.core.config_loader import to_yaml
from grpo_sdk.core.context import RunContext
from grpo_sdk.core.checkpoint import CheckpointManager
from grpo_sdk.core.data import make_prompt_source, make_validation_prompts
from grpo_sdk.core.errors import GrpoSdkError, NonFiniteError
from grpo_sdk.core.models import load_tokenizer
from grpo_sdk.core.records import SamplingParams
from grpo_sdk.core.rollout import RolloutBatch, collect_rollouts, rollout_metrics
from grpo_sdk.core.run import RunSummary, dump_batch, restore_checkpoint, run_training
from grpo_sdk.core.run_dir import RunLock, check_storage, write_text_atomic
from grpo_sdk.core.signals import STOP
from grpo_sdk.recipes.tiny_model import resolve_model_path
from grpo_sdk.runtime import make_runtime


def checkpoint_bytes(model_path: str, cfg: MasterConfig) -> int:
    """About what one checkpoint of this model takes: weights, plus AdamW's two moments when saved."""
    path = Path(model_path)
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) + sum(
        p.stat().st_size for p in path.glob("*.bin")) if path.is_dir() else 0
    return weights * (3 if cfg.checkpointing.save_optimizer else 1)


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise GrpoSdkError("cluster.device=cuda but torch sees no CUDA device")
    return requested


class GRPOTrainer:
    """Builds the components of a run and trains; ``run`` for observer hooks is this object."""

    def __init__(self, config: MasterConfig, *, run_dir: str | Path, registry: Any, resume: bool = False):
        self.config = config
        self.run_dir = Path(run_dir)
        self.registry = registry
        self.resume = resume  # continue from the latest checkpoint in run_dir, if there is one
        self.step = 0
        self.next_group_id = 0
        self.reward_first: float | None = None
        self.reward_tail: list[float] = []  # the last 10 steps' mean rewards, for the summary
        self.last_validation: dict[str, float] = {}
        self.reward_failures: list[tuple[int, int]] = []  # (failed, scored) of recent batches
        self.checkpoints = CheckpointManager(config.checkpointing, self.run_dir)

    def record_reward(self, reward: float) -> None:
        if self.reward_first is None:
            self.reward_first = reward
        self.reward_tail = (self.reward_tail + [reward])[-10:]

    # --- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.config
        if cfg.cluster.num_threads:
            torch.set_num_threads(cfg.cluster.num_threads)
        random.seed(cfg.grpo.seed)
        torch.manual_seed(cfg.grpo.seed)
        check_storage(self.run_dir, self.checkpoints.directory if cfg.checkpointing.enabled else None)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.locks = [RunLock(self.run_dir).acquire()]
        if cfg.checkpointing.enabled and self.checkpoints.directory.resolve().parent != self.run_dir.resolve():
            self.locks.append(RunLock(self.checkpoints.directory).acquire())  # shared elsewhere: guard it too
        try:  # disk full or a vanished mount before the first step: a clear error, not a traceback
            write_text_atomic(self.run_dir / "config.resolved.yaml", to_yaml(cfg))
            write_text_atomic(self.run_dir / "plugins.json", json.dumps(self._plugin_versions(), indent=2) + "\n")
            self.checkpoints.remove_partial()
            model_path = resolve_model_path(cfg.policy.model_name, self.run_dir, cfg.grpo.seed)
        except (OSError, SafetensorError) as exc:  # safetensors reports ENOSPC as its own error type
            detail = f"{exc.strerror} ({exc.filename or self.run_dir})" if isinstance(exc, OSError) else str(exc)
            raise GrpoSdkError(f"could not write to the run directory {self.run_dir}: {detail}") from exc
        latest = self.checkpoints.latest_verified(warn=lambda m: print(m, file=sys.stderr, flush=True)) \
            if self.resume else None
        if cfg.checkpointing.enabled:  # room for one checkpoint, before hours of training make one
            check_storage(self.run_dir, self.checkpoints.directory, checkpoint_bytes(model_path, cfg))
        self.context = RunContext(
            resume_step=(int(latest.name.split("_")[1]) if latest else 0) if self.resume else None,
            config=cfg, run_dir=self.run_dir, model_path=model_path,
            tokenizer_path=cfg.policy.tokenizer.name or model_path,
            # On Ray each worker picks its own device; the driver may have none.
            device=pick_device(cfg.cluster.device) if cfg.cluster.runtime == "local" else cfg.cluster.device,
            seed=cfg.grpo.seed, needs_reference=cfg.loss_fn.reference_policy_kl_penalty > 0,
            registry=self.registry,
        )
        self.runtime = make_runtime(cfg, self.registry)
        STOP.reinstall()  # ray.init installs a SIGTERM handler of its own
        self.policy = self._build("policy", cfg.policy)
        self.generation = self._build("generation", cfg.policy.generation)
        self.environment = self._build("environment", cfg.env)
        self.estimator = self._build("estimator", cfg.grpo.adv_estimator)
        self.weight_sync = self._build("weight_sync", cfg.weight_sync)
        in_loss_threshold = cfg.grpo.seq_logprob_error_threshold if cfg.loss_fn.seq_logprob_error_in_loss else None
        self.loss_fn = ClippedPGLoss(cfg.loss_fn, seq_logprob_error_threshold=in_loss_threshold)

        # What this step needs beyond rewards follows from the config and the estimator's declared
        # capabilities, never from its name.
        needs = self.registry.get("estimator", cfg.grpo.adv_estimator.name).capabilities
        rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        self.needs_prev_logprobs = (
            (cfg.policy.train_global_batch_size or rows) < rows  # several optimizer steps: freeze "old"
            or "prev_logprobs" in needs
            or (cfg.loss_fn.use_kl_in_reward and cfg.loss_fn.reference_policy_kl_penalty > 0)
            or (cfg.grpo.seq_logprob_error_threshold is not None and not cfg.loss_fn.seq_logprob_error_in_loss))
        self.teacher = self._build_teacher() if "teacher_logprobs" in needs else None

        self.tokenizer = load_tokenizer(self.context.tokenizer_path)
        gen = cfg.policy.generation
        self.sampling = SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                       top_p=gen.top_p, top_k=gen.top_k, stop_token_ids=tuple(gen.stop_token_ids))
        self.max_prompt_tokens = cfg.data.max_input_seq_length or (
            cfg.policy.max_total_sequence_length - gen.max_new_tokens)
        self.prompts = make_prompt_source(cfg, self.environment, self.tokenizer, self.max_prompt_tokens)
        self.val_prompts = make_validation_prompts(cfg, self.environment, self.tokenizer, self.max_prompt_tokens)
        if latest is not None:
            restore_checkpoint(self, latest)
        # Loggers last: one that opens a remote run (W&B, MLflow) must not be left open by a failed setup.
        self.loggers = [self._build("logger", cfg.logger, name) for name in cfg.logger.loggers]

    def _build_teacher(self) -> Any:
        """The on-policy-distillation teacher: any policy backend, loaded from a model or checkpoint dir."""
        opd = self.config.on_policy_distillation
        precision = opd.teacher_precision or self.config.policy.precision
        config = attrs.evolve(self.config, policy=attrs.evolve(self.config.policy, precision=precision))
        context = attrs.evolve(self.context, config=config, model_path=opd.teacher_model, needs_reference=False)
        return self.runtime.build("policy", opd.teacher_backend, None, context)

    def _build(self, kind: str, section: Any, name: str | None = None) -> Any:
        name = name or getattr(section, type(section).__plugin__.selector)
        return self.runtime.build(kind, name, plugin_config(section, name), self.context)

    def _plugin_versions(self) -> dict[str, Any]:
        from grpo_sdk import __version__

        return {"grpo_sdk": __version__, "torch": torch.__version__,
                "components": [info.to_json() for info in self.registry.list()],
                "hooks": [p.to_json() for p in self.registry.hook_plugins]}

    # --- one step -------------------------------------------------------------------------------

    def collect_rollouts(self) -> tuple[RolloutBatch, dict[str, float]]:
        """Rollouts for one step, through the reward pipeline: scale, shape, and (dynamic sampling)
        keep only prompt groups with a learning signal, generating more batches until there are
        num_prompts_per_step of them."""
        grpo = self.config.grpo
        target_rows = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
        dynamic = grpo.use_dynamic_sampling
        draw = int(grpo.num_prompts_per_step * grpo.batch_multiplier) if dynamic else grpo.num_prompts_per_step
        generated, kept, env_metrics = [], [], {}
        for generation_batch in range(1, (grpo.dynamic_sampling_max_gen_batches if dynamic else 1) + 1):
            rollouts, env_metrics = collect_rollouts(
                prompts=self.prompts.next_prompts(draw), tokenizer=self.tokenizer, generation=self.generation,
                environment=self.environment, cfg=self.config, sampling=self.sampling,
                max_prompt_tokens=self.max_prompt_tokens, group_offset=self.next_group_id)
            self.next_group_id += draw
            self._process_rewards(rollouts)
            generated.append(rollouts)
            self._check_reward_failures(rollouts)
            trivial = trivial_groups(rollouts.unshaped_rewards, rollouts.group_ids)
            if not dynamic:
                return rollouts, {**rollout_metrics(generated, trivial), **env_metrics}
            kept.append(rollouts.select(~trivial))
            if sum(b.batch_size for b in kept) >= target_rows:
                batch = RolloutBatch.concat(kept)
                metrics = rollout_metrics(generated, torch.cat([trivial_groups(b.unshaped_rewards, b.group_ids)
                                                                for b in generated]))
                metrics.update({"dynamic_sampling_num_gen_batches": float(generation_batch),
                                "dynamic_sampling_num_discarded_valid_samples": float(batch.batch_size - target_rows),
                                "filtered_reward": float(batch.select(torch.arange(target_rows)).rewards.mean())})
                return batch.select(torch.arange(target_rows)), {**metrics, **env_metrics}
        found = sum(b.batch_size for b in kept)
        raise GrpoSdkError(
            f"dynamic sampling found {found} of the {target_rows} rows it needs in {grpo.dynamic_sampling_max_gen_batches} "
            f"generation batches of {draw} prompts: every other prompt group had identical rewards. Raise "
            "grpo.dynamic_sampling_max_gen_batches or grpo.batch_multiplier, or check the reward function.")

    def _check_reward_failures(self, rollouts: RolloutBatch) -> None:
        """With env.on_reward_error=mask, stop a run whose rewards keep failing (instead of hundreds of
        steps of `reward nan`): any batch where every sample failed, or too many over a window."""
        env = self.config.env
        failed, total = int((~rollouts.reward_valid).sum()), rollouts.batch_size
        self.reward_failures = (self.reward_failures + [(failed, total)])[-env.failed_window_steps:]
        window_failed = sum(f for f, _ in self.reward_failures)
        window_total = sum(t for _, t in self.reward_failures)
        if failed == total and total:
            why = f"every one of the {total} samples of step {self.step + 1} failed to get a reward"
        elif window_total and window_failed / window_total > env.max_failed_fraction:
            why = (f"{window_failed} of the last {window_total} samples ({window_failed / window_total:.0%}) "
                   f"failed to get a reward, more than env.max_failed_fraction={env.max_failed_fraction:g}")
        else:
            return
        raise GrpoSdkError(f"environment {env.name!r}: {why} (env.on_reward_error=mask). The reward function is "
                           "probably broken: run with env.on_reward_error=raise to see the first failure.")

    def _process_rewards(self, rollouts: RolloutBatch) -> None:
        grpo = self.config.grpo
        components = {k: scale_rewards(v, grpo.reward_scaling) for k, v in rollouts.reward_components.items()}
        total = scale_rewards(torch.stack(list(rollouts.reward_components.values())).sum(0), grpo.reward_scaling)
        rollouts.reward_components = components
        rollouts.unshaped_rewards = total
        rollouts.rewards = shape_rewards(total, rollouts.response_lengths, rollouts.truncated, grpo.reward_shaping,
                                         self.sampling.max_new_tokens)

    def train_step(self) -> tuple[dict[str, float], RolloutBatch]:
        cfg = self.config
        timings: dict[str, float] = {}
        start = time.perf_counter()
        rollouts, metrics = self.collect_rollouts()
        timings["rollout"] = time.perf_counter() - start

        sample_mask = rollouts.reward_valid.float()
        if cfg.grpo.overlong_filtering:  # out of the loss, still in the baseline
            sample_mask = sample_mask * (~rollouts.truncated).float()
        batch = rollouts.to_train_batch(sample_mask)

        tick = time.perf_counter()
        if self.needs_prev_logprobs:
            batch.prev_logprobs = self.policy.logprobs(batch)
        if self.context.needs_reference:
            batch.reference_logprobs = self.policy.reference_logprobs(batch)
        teacher_logprobs = self.teacher.logprobs(batch) if self.teacher is not None else None
        timings["logprobs"] = time.perf_counter() - tick

        if batch.prev_logprobs is not None and not cfg.loss_fn.seq_logprob_error_in_loss:
            errors, valid = seq_logprob_errors(batch.prev_logprobs, batch.generation_logprobs, batch.token_mask,
                                               batch.sample_mask)
            batch.sample_mask, seq_metrics = mask_by_seq_logprob_error(
                errors, valid, batch.sample_mask, batch.rewards, cfg.grpo.seq_logprob_error_threshold)
            metrics.update(seq_metrics)

        mask = batch.token_mask * batch.sample_mask[:, None]
        advantages = self.estimator.compute_advantages(
            batch.rewards, batch.group_ids, mask, reward_components=rollouts.reward_components,
            valid_mask=rollouts.reward_valid, sample_mask=batch.sample_mask, prev_logprobs=batch.prev_logprobs,
            reference_logprobs=batch.reference_logprobs, teacher_logprobs=teacher_logprobs,
            generation_logprobs=batch.generation_logprobs, metadata=rollouts.metadata)
        batch.advantages = clip_advantages(advantages, cfg.grpo.advantage_clip_low, cfg.grpo.advantage_clip_high)
        metrics.update(getattr(self.estimator, "last_metrics", None) or {})
        response_advantages = batch.advantages[mask > 0]
        if response_advantages.numel():
            metrics.update({"advantages/mean": float(response_advantages.mean()),
                            "advantages/min": float(response_advantages.min()),
                            "advantages/max": float(response_advantages.max())})

        tick = time.perf_counter()
        metrics.update(self.policy.train(batch, self.loss_fn))
        timings["train"] = time.perf_counter() - tick
        if cfg.logger.dump_train_data:
            dump_batch(self.run_dir / "train_data" / f"step_{self.step + 1}.jsonl", rollouts, batch)

        tick = time.perf_counter()
        self.weight_sync.sync_weights(self.policy, self.generation, version=self.step + 1)
        timings["weight_sync"] = time.perf_counter() - tick
        timings["step"] = time.perf_counter() - start
        metrics.update({f"timing/{k}": v for k, v in timings.items()})
        metrics["perf/tokens_per_sec"] = metrics["generated_tokens"] / timings["step"]
        metrics["perf/rollout_tokens_per_sec"] = metrics["generated_tokens"] / timings["rollout"]
        return metrics, rollouts

    # --- the run --------------------------------------------------------------------------------

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> RunSummary:
        """Train to the end (steps, epochs, early stop or deadline); see ``grpo_sdk.core.run``."""
        return run_training(self, on_step)

    def shutdown(self) -> None:
        try:
            for component in ("generation", "policy", "teacher"):
                obj = getattr(self, component, None)
                if obj is not None:
                    obj.shutdown()
            if hasattr(getattr(self, "environment", None), "shutdown"):  # e.g. the math verifier's worker pool
                self.environment.shutdown()
            if getattr(self, "runtime", None) is not None:
                self.runtime.shutdown()
        finally:
            for lock in getattr(self, "locks", []):
                lock.release()
            self.locks = []
