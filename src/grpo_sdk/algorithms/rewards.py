"""The reward pipeline between the environment and the estimator, in pure torch.

Order in a step (as NeMo-RL's synchronous loop): reward penalties -> length penalty (both on the
environment's rewards, where NeMo-RL's NeMo-Gym rollout applies them) -> scale -> shape ->
triviality / dynamic sampling -> overlong filtering -> sequence logprob-error masking ->
advantages -> clipping.
Restated in docs/algorithms.md (One step, in order); the differences from NeMo-RL are in
docs/decisions.md.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from grpo_sdk.algorithms.effort_levels import apply_effort_levels, generated_length, last_user_message
from grpo_sdk.algorithms.length_penalty import CHANNELS, apply_length_penalty, length_penalty_active
from grpo_sdk.algorithms.reward_penalties import any_penalty, apply_penalties, generated_turns, penalty_flags, \
    reasoning_and_answer, resolve_think_tags
from grpo_sdk.config.schema import MasterConfig, RewardScalingConfig, RewardShapingConfig


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


class RolloutRewardChanges:
    """NeMo-RL's rollout-side reward changes, in its order: ``reward_penalties.*``, then (training only)
    ``grpo.length_penalty`` and ``grpo.effort_levels``, on the environment's rewards, before scaling
    and shaping.

    The components come back with the penalties applied and nothing else: they stay the raw
    environment reward (NeMo-RL's ``env_reward``), while the total carries the length penalty too.

    Example::

        changes = RolloutRewardChanges(cfg, tokenizer)
        components, total, metrics = changes(batch.reward_components, batch.reward_valid, batch.group_ids,
                                             batch.message_logs, batch.metadata)
    """

    def __init__(self, config: MasterConfig, tokenizer: Any = None):
        self.penalties, self.length = config.reward_penalties, config.grpo.length_penalty
        self.effort = getattr(config.grpo, "effort_levels", None)  # absent from hand-built configs: off
        self.tokenizer = tokenizer
        self.penalize, self.shape_length = any_penalty(self.penalties), length_penalty_active(self.length)
        self.tags = resolve_think_tags(self.penalties, tokenizer) if self.penalize or self.shape_length else None
        self.warned = False

    def __call__(self, components: dict[str, torch.Tensor], valid: torch.Tensor, group_ids: torch.Tensor,
                 message_logs: Sequence[Sequence[Any]], metadata: Sequence[dict[str, Any]],
                 prompt_ids: Sequence[Sequence[int]] | None = None, *, training: bool = True
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, float]]:
        """``(components, total, metrics)``; ``prompt_ids``: each row's prompt tokens as the model saw
        them (for the thinking mode when a prompt's messages carry no token ids)."""
        metrics: dict[str, float] = {}
        if training and self.effort is not None and self.effort.active:
            components, total, metrics = self._changes(components, valid, group_ids, message_logs, metadata,
                                                       prompt_ids, training)
            rewards, effort_metrics = apply_effort_levels(
                total.tolist(), valid.tolist(), [last_user_message(log) for log in message_logs],
                [generated_length(log) for log in message_logs], self.effort)
            return components, torch.tensor(rewards, dtype=total.dtype), {**metrics, **effort_metrics}
        return self._changes(components, valid, group_ids, message_logs, metadata, prompt_ids, training)

    def _changes(self, components: dict[str, torch.Tensor], valid: torch.Tensor, group_ids: torch.Tensor,
                 message_logs: Sequence[Sequence[Any]], metadata: Sequence[dict[str, Any]],
                 prompt_ids: Sequence[Sequence[int]] | None, training: bool,
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, float]]:
        metrics: dict[str, float] = {}
        if not self.penalize and not (training and self.shape_length):
            return components, torch.stack(list(components.values())).sum(0), metrics
        samples = [generated_turns(log, self.tags, prompt_ids[i] if prompt_ids is not None else None)
                   for i, log in enumerate(message_logs)]
        if self.penalize:
            components, metrics = apply_penalties(components, penalty_flags(self.penalties, self.tags, samples))
        total = torch.stack(list(components.values())).sum(0)
        if training and self.shape_length:
            rewards, length_metrics = apply_length_penalty(
                total.tolist(), self._groups(valid, group_ids), self._lengths(samples), metadata, self.length,
                single_component=len(components) == 1)
            metrics.update(length_metrics)
            if length_metrics["length_penalty/skipped_non_binary_frac"] and not self.warned:
                self.warned = True  # once per run, as upstream warns once per agent
                warnings.warn("grpo.length_penalty needs 0/1 rewards from a single reward component: "
                              f"{length_metrics['length_penalty/skipped_non_binary_frac']:.0%} of the samples were "
                              "left unchanged (length_penalty/skipped_non_binary_frac)", stacklevel=2)
            total = torch.tensor(rewards, dtype=total.dtype)
        return components, total, metrics

    @staticmethod
    def _groups(valid: torch.Tensor, group_ids: torch.Tensor) -> list[list[int]]:
        # Rows whose reward failed are in no group: they stay 0 and out of the baseline, as everywhere.
        groups: dict[int, list[int]] = {}
        for i, (gid, ok) in enumerate(zip(group_ids.tolist(), valid.tolist())):
            if ok:
                groups.setdefault(gid, []).append(i)
        return list(groups.values())

    def _lengths(self, samples: Sequence[Sequence[Any]]) -> dict[str, list[float]]:
        texts = [reasoning_and_answer(turns, self.tags) for turns in samples]
        if self.length.default.length_type == "tokens" and self.tokenizer is not None:
            flat = [t for pair in texts for t in pair]
            encoded = self.tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
            counts = [float(len(ids)) if text else 0.0 for text, ids in zip(flat, encoded)]
        else:  # upstream counts characters when no tokenizer is at hand
            counts = [float(len(t)) for pair in texts for t in pair]
        reasoning, answer = counts[0::2], counts[1::2]
        return dict(zip(CHANNELS, (reasoning, answer, [r + a for r, a in zip(reasoning, answer)])))


def mean_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Per-row means of several batches (dynamic sampling's generation batches), weighted by their rows."""
    rows = sum(n for _, n in parts)
    keys = {k for metrics, _ in parts for k in metrics}
    return {k: sum(m.get(k, 0.0) * n for m, n in parts) / rows for k in sorted(keys)} if rows else {}
