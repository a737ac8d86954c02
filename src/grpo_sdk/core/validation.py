"""Validation: sample the validation prompts with the current policy and score them.

Validation samples from a fixed seed (``SamplingParams.seed``), so it never perturbs the
training sampler's random stream, and the same weights always give the same validation
numbers. Rewards are the environment's raw rewards (no scaling or shaping).

Metrics (logged as ``val/<name>``, as the seed names them):

* ``accuracy``: mean reward over every validation sample;
* ``pass_k`` (k = ``grpo.val_num_generations_per_prompt`` > 1): fraction of prompts with at
  least one sample whose reward is >= 1, i.e. fully correct (the seed counted any reward > 0,
  which partial-credit rewards would make meaningless);
* ``avg_length``: mean response length in tokens; plus the environment's own metrics.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from grpo_sdk.core.rollout import RolloutBatch, collect_rollouts

VALIDATION_SEED_OFFSET = 7_919  # validation's sampling seed is grpo.seed + this + step


def validate(trainer: Any, step: int) -> tuple[dict[str, float], list[RolloutBatch]]:
    cfg = trainer.config
    k = cfg.grpo.val_num_generations_per_prompt
    prompts = trainer.val_prompts
    sampling = attrs.evolve(trainer.sampling, seed=cfg.grpo.seed + VALIDATION_SEED_OFFSET + step)
    batches, env_metrics = [], []
    for start in range(0, len(prompts), cfg.grpo.val_batch_size):
        batch, metrics = collect_rollouts(
            prompts=prompts[start:start + cfg.grpo.val_batch_size], tokenizer=trainer.tokenizer,
            generation=trainer.generation, environment=trainer.environment, cfg=cfg, sampling=sampling,
            max_prompt_tokens=trainer.max_prompt_tokens, group_offset=start, num_generations=k)
        batch.rewards = torch.stack(list(batch.reward_components.values())).sum(0)  # raw: no scaling, no shaping
        batches.append(batch)
        env_metrics.append(metrics)
    rewards = torch.cat([b.rewards for b in batches])
    valid = torch.cat([b.reward_valid for b in batches])
    lengths = torch.cat([b.response_lengths for b in batches]).float()
    out = {"accuracy": float(rewards[valid].mean()) if valid.any() else float("nan"),
           "avg_length": float(lengths.mean()), "num_samples": float(len(rewards))}
    if k > 1:
        passed = ((rewards >= 1.0) & valid).view(-1, k).any(dim=1)
        out["pass_k"] = float(passed.float().mean())
    for key in env_metrics[0]:
        out[key.removeprefix("env/")] = sum(m[key] for m in env_metrics) / len(env_metrics)
    return out, batches
