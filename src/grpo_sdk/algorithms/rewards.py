"""The reward pipeline between the environment and the estimator, in pure torch.

Order in a step (as NeMo-RL's synchronous loop): scale -> shape -> triviality / dynamic
sampling -> overlong filtering -> sequence logprob-error masking -> advantages -> clipping.
Restated in docs/algorithms.md (One step, in order); the differences from the seed are in
docs/decisions.md.
"""

from __future__ import annotations

import warnings

import torch

from grpo_sdk.core.config import RewardScalingConfig, RewardShapingConfig


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """Clamp to ``[source_min, source_max]``, then map that interval linearly onto the target one."""
    if not cfg.enabled:
        return rewards
    outside = int(((rewards < cfg.source_min) | (rewards > cfg.source_max)).sum())
    if outside:
        warnings.warn(f"reward scaling: {outside} of {rewards.numel()} rewards were outside "
                      f"[{cfg.source_min}, {cfg.source_max}] and were clamped", stacklevel=2)
    clamped = rewards.clamp(cfg.source_min, cfg.source_max)
    span = cfg.source_max - cfg.source_min
    return cfg.target_min + (clamped - cfg.source_min) / span * (cfg.target_max - cfg.target_min)


def shape_rewards(rewards: torch.Tensor, response_lengths: torch.Tensor, truncated: torch.Tensor,
                  cfg: RewardShapingConfig, max_new_tokens: int) -> torch.Tensor:
    """DAPO's overlong penalty, or the stop-properly penalty when its coefficient is set.

    Overlong: ``r += min(-(L - (L_max - buffer)) / buffer * penalty, 0)``, not capped at
    ``-penalty`` (upstream behaviour; generation stops at ``max_new_tokens`` in practice).
    Stop-properly: ``r *= coef`` for truncated responses; it takes precedence.
    """
    if not cfg.enabled:
        return rewards
    if cfg.stop_properly_penalty_coef is not None:
        return torch.where(truncated.bool(), rewards * cfg.stop_properly_penalty_coef, rewards)
    max_length = cfg.max_response_length or max_new_tokens
    expected = max_length - cfg.overlong_buffer_length
    penalty = -(response_lengths.to(rewards.dtype) - expected) / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty
    return rewards + penalty.clamp(max=0.0)


def trivial_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: True where every reward of the row's group is exactly equal.

    Exact equality, not ``std == 0``: a leave-one-out std is 0 for a lone success among
    failures, which would split the group (the snapshot's pitfall, docs/decisions.md).
    """
    _, group = torch.unique(group_ids, return_inverse=True)
    size = int(group.max()) + 1 if group.numel() else 0
    high = torch.full((size,), float("-inf"), dtype=rewards.dtype).scatter_reduce(0, group, rewards, "amax")
    low = torch.full((size,), float("inf"), dtype=rewards.dtype).scatter_reduce(0, group, rewards, "amin")
    return (high == low)[group]


def seq_logprob_errors(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, token_mask: torch.Tensor,
                       sample_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence multiplicative probability error ``mean_t exp(|gen - prev|)`` and its validity.

    Inputs are input-aligned ``[B, S]``; rows without a valid token get error 0 and valid False.
    Non-finite values at masked positions are ignored.
    """
    mask = token_mask[:, 1:] * sample_mask[:, None]
    diff = (generation_logprobs[:, 1:] - prev_logprobs[:, 1:]).abs()
    per_token = torch.where(mask > 0, torch.exp(diff), torch.zeros_like(diff)) * mask
    count = mask.sum(-1)
    valid = count > 0
    errors = torch.where(valid, per_token.sum(-1) / count.clamp(min=1), torch.zeros_like(count))
    return errors.detach(), valid


def mask_by_seq_logprob_error(errors: torch.Tensor, valid: torch.Tensor, sample_mask: torch.Tensor,
                              rewards: torch.Tensor, threshold: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Drop rows whose error exceeds ``threshold`` (or is NaN) from the loss; always report the statistics.

    Rows without valid tokens are kept (their error is 0) and left out of the statistics. Without a
    threshold nothing is dropped and the ``_after_mask`` statistics equal the others, as upstream logs them.
    """
    def stats(keep: torch.Tensor, suffix: str) -> dict[str, float]:
        chosen = errors[keep]
        if chosen.numel() == 0:
            return {f"{k}_seq_mult_prob_error{suffix}": 0.0 for k in ("max", "mean", "min")}
        return {f"max_seq_mult_prob_error{suffix}": float(chosen.max()),
                f"mean_seq_mult_prob_error{suffix}": float(chosen.mean()),
                f"min_seq_mult_prob_error{suffix}": float(chosen.min())}

    if threshold is None:
        rejected = torch.zeros_like(valid)
    else:  # "not <=" rather than ">": a NaN error (a NaN or -inf logprob at a valid token) is rejected too
        rejected = valid & ~(errors <= threshold) & (sample_mask > 0)
    new_mask = sample_mask * (~rejected).to(sample_mask.dtype)
    num_masked = int(rejected.sum())
    metrics = stats(valid, "")
    metrics["num_masked_seqs_by_logprob_error"] = float(num_masked)
    metrics["masked_correct_pct"] = int((rewards[rejected] == 1).sum()) / num_masked if num_masked else 0.0
    metrics.update(stats(valid & (new_mask > 0), "_after_mask"))
    return new_mask, metrics


def clip_advantages(advantages: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    if low is not None:
        advantages = advantages.clamp(min=low)
    if high is not None:
        advantages = advantages.clamp(max=high)
    return advantages
