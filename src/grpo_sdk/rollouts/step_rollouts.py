"""One training step's rollouts, from prompts to the rewards the estimator sees.

Draw ``num_prompts_per_step`` prompts, generate G responses each, score them, run the reward
pipeline (scaling, then shaping), and with dynamic sampling keep only prompt groups with a
learning signal, generating more batches until there are enough. The reward-failure window
(``env.on_reward_error=mask``) is watched here, where the batches are scored.

The synchronous loop calls ``collect`` once per step. The asynchronous one (issue 15,
docs/async.md) calls the same code per target step from its collector, which is what makes
``grpo.async_grpo.max_trajectory_age_steps=0`` the synchronous loop exactly.

The counters that must survive a resume (the next group id, the failure window) live in a
``RolloutCounters`` the caller owns and checkpoints (the trainer's ``TrainerState``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from grpo_sdk.algorithms.rewards import RolloutRewardChanges, mean_metrics, scale_rewards, shape_rewards, \
    trivial_groups
from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.core.records import SamplingParams
from grpo_sdk.rollouts.rollout import RolloutBatch, collect_rollouts, rollout_metrics

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig


class RolloutCounters(Protocol):
    next_group_id: int  # group ids keep counting across steps, so groups never collide
    reward_failures: list[list[int]]  # [failed, scored] of recent batches


class StepRollouts:
    """Example::

        rollouts = StepRollouts(cfg, prompts=source, tokenizer=tok, generation=gen, environment=env,
                                sampling=SamplingParams(max_new_tokens=5), max_prompt_tokens=59)
        batch, metrics = rollouts.collect(step=1, counters=trainer_state)
    """

    def __init__(self, config: MasterConfig, *, prompts: Any, tokenizer: Any, generation: Any, environment: Any,
                 sampling: SamplingParams, max_prompt_tokens: int):
        self.config = config
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.generation = generation
        self.environment = environment
        self.sampling = sampling
        self.max_prompt_tokens = max_prompt_tokens
        self.reward_changes = RolloutRewardChanges(config, tokenizer)

    def collect(self, step: int, counters: RolloutCounters) -> tuple[RolloutBatch, dict[str, float]]:
        """The rollouts of training step ``step`` (1-based: the step they will train) and their metrics."""
        grpo = self.config.grpo
        target_rows = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
        dynamic = grpo.use_dynamic_sampling
        draw = int(grpo.num_prompts_per_step * grpo.batch_multiplier) if dynamic else grpo.num_prompts_per_step
        generated, kept, env_metrics, reward_metrics = [], [], {}, []
        for generation_batch in range(1, (grpo.dynamic_sampling_max_gen_batches if dynamic else 1) + 1):
            rollouts, env_metrics = collect_rollouts(
                prompts=self.prompts.next_prompts(draw), tokenizer=self.tokenizer, generation=self.generation,
                environment=self.environment, cfg=self.config, sampling=self.sampling,
                max_prompt_tokens=self.max_prompt_tokens, group_offset=counters.next_group_id)
            counters.next_group_id += draw
            reward_metrics.append((self.process_rewards(rollouts), rollouts.batch_size))
            generated.append(rollouts)
            self.check_reward_failures(rollouts, step, counters)
            trivial = trivial_groups(rollouts.unshaped_rewards, rollouts.group_ids)
            if not dynamic:
                return rollouts, {**rollout_metrics(generated, trivial), **env_metrics, **mean_metrics(reward_metrics)}
            kept.append(rollouts.select(~trivial))
            if sum(b.batch_size for b in kept) >= target_rows:
                batch = RolloutBatch.concat(kept)
                metrics = rollout_metrics(generated, torch.cat([trivial_groups(b.unshaped_rewards, b.group_ids)
                                                                for b in generated]))
                metrics.update({"dynamic_sampling_num_gen_batches": float(generation_batch),
                                "dynamic_sampling_num_discarded_valid_samples": float(batch.batch_size - target_rows),
                                "filtered_reward": float(batch.select(torch.arange(target_rows)).rewards.mean())})
                metrics.update(mean_metrics(reward_metrics))
                return batch.select(torch.arange(target_rows)), {**metrics, **env_metrics}
        found = sum(b.batch_size for b in kept)
        raise GrpoSdkError(
            f"dynamic sampling found {found} of the {target_rows} rows it needs in {grpo.dynamic_sampling_max_gen_batches} "
            f"generation batches of {draw} prompts: every other prompt group had identical rewards. Raise "
            "grpo.dynamic_sampling_max_gen_batches or grpo.batch_multiplier, or check the reward function.")

    def process_rewards(self, rollouts: RolloutBatch) -> dict[str, float]:
        """The reward penalties and the length penalty (``RolloutRewardChanges``, NeMo-RL's rollout-side
        changes), then scale the components and their total (grpo.reward_scaling), then shape the total
        (grpo.reward_shaping). Returns the penalties' metrics."""
        grpo = self.config.grpo
        prompts = None if self.reward_changes.tags is None else [
            row[mask.bool()].tolist() for row, mask in zip(rollouts.prompt_ids, rollouts.prompt_mask)]
        raw, total, metrics = self.reward_changes(rollouts.reward_components, rollouts.reward_valid,
                                                  rollouts.group_ids, rollouts.message_logs, rollouts.metadata, prompts)
        components = {k: scale_rewards(v, grpo.reward_scaling) for k, v in raw.items()}
        total = scale_rewards(total, grpo.reward_scaling)
        rollouts.reward_components = components
        rollouts.unshaped_rewards = total
        # The model's own tokens: a multi-turn response also holds the environment's turns.
        rollouts.rewards = shape_rewards(total, rollouts.generated_lengths, rollouts.truncated, grpo.reward_shaping,
                                         self.sampling.max_new_tokens)
        return metrics

    def check_reward_failures(self, rollouts: RolloutBatch, step: int, counters: RolloutCounters) -> None:
        """With env.on_reward_error=mask, stop a run whose rewards keep failing (instead of hundreds of
        steps of `reward nan`): any batch where every sample failed, or too many over a window."""
        env = self.config.env
        # A sample with no reward (None) is not a failure: masked, but no sign of a broken reward function.
        failed, total = int((~rollouts.reward_valid & ~rollouts.reward_missing).sum()), rollouts.batch_size
        counters.reward_failures = (counters.reward_failures + [[failed, total]])[-env.failed_window_steps:]
        window_failed = sum(f for f, _ in counters.reward_failures)
        window_total = sum(t for _, t in counters.reward_failures)
        if failed == total and total:
            why = f"every one of the {total} samples of step {step} failed to get a reward"
        elif window_total and window_failed / window_total > env.max_failed_fraction:
            why = (f"{window_failed} of the last {window_total} samples ({window_failed / window_total:.0%}) "
                   f"failed to get a reward, more than env.max_failed_fraction={env.max_failed_fraction:g}")
        else:
            return
        raise GrpoSdkError(f"environment {env.name!r}: {why} (env.on_reward_error=mask). The reward function is "
                           "probably broken: run with env.on_reward_error=raise to see the first failure.")
