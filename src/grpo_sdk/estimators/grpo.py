"""GRPO advantages: reward minus a per-group baseline, optionally divided by the group std.

The math follows NeMo-RL's ``calculate_baseline_and_std_per_prompt`` and ``GRPOAdvantageEstimator``
(restated in shared/research/nemo-rl-reference.md §2.2 and §3.1), vectorised over groups with
``index_add`` instead of a Python loop over prompts:

* group-mean baseline: ``b = mean of the group's valid rewards``, ``std`` = unbiased std;
* leave-one-out: ``b_i`` = mean of the *other* valid rows, ``std_i`` = their unbiased std, so
  a 2-row group is never std-normalised and a lone success keeps its raw advantage;
* a group with at most one valid row gets ``b_i = r_i`` (advantage 0) and std 0;
* ``A = (r - b) / (std + 1e-6)`` only where ``std > 0``; rows with zero std keep ``r - b``.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_sdk.core.context import RunContext
from grpo_sdk.estimators.specs import GRPOEstimatorConfig


def baseline_and_std_per_group(rewards: torch.Tensor, group_ids: torch.Tensor, valid_mask: torch.Tensor | None = None,
                               *, leave_one_out: bool = True, std_rewards: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(baseline, std)`` of each row's group, both ``[B]``.

    ``std_rewards`` (DAPO) takes the std over another signal than the baseline's rewards.
    """
    if rewards.numel() == 0:
        return rewards.clone(), rewards.clone()
    out_dtype = rewards.dtype
    # float64 inside: leave-one-out sums (total - own) are then exact for float32 rewards, so a group
    # of identical rewards gets exactly zero advantage, as upstream's matrix form gives.
    rewards = rewards.double()
    valid = torch.ones_like(rewards) if valid_mask is None else valid_mask.double()
    signal = rewards if std_rewards is None else std_rewards.double()
    _, group = torch.unique(group_ids.reshape(len(rewards), -1), dim=0, return_inverse=True)
    num_groups = int(group.max()) + 1

    def group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, group, x)[group]

    n_valid = group_sum(valid)
    own = valid if leave_one_out else torch.zeros_like(valid)
    k = n_valid - 1 if leave_one_out else n_valid
    baseline = (group_sum(valid * rewards) - own * rewards) / k
    mean = (group_sum(valid * signal) - own * signal) / k
    mean_sq = (group_sum(valid * signal * signal) - own * signal * signal) / k
    std = torch.sqrt((mean_sq - mean * mean) * k / (k - 1)).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    alone = n_valid <= 1
    baseline = torch.where(alone, rewards, baseline)
    std = torch.where(alone, torch.zeros_like(std), std)
    return baseline.to(out_dtype), std.to(out_dtype)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_rewards: bool = True,
                    leave_one_out: bool = True, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row ``[B]`` GRPO advantages."""
    baseline, std = baseline_and_std_per_group(rewards, group_ids, valid_mask, leave_one_out=leave_one_out)
    advantages = rewards - baseline  # exact zero when every reward of the group is equal
    if normalize_rewards:
        advantages = torch.where(std > 0, advantages / (std + 1e-6), advantages)
    return advantages


class GRPOEstimator:
    """Example::

        est = GRPOEstimator(GRPOEstimatorConfig(use_leave_one_out_baseline=False), context=None)
        est.compute_advantages(torch.tensor([2., 2., 1., 3.]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3))
        # tensor([[ 0.0000,  0.0000,  0.0000], [ 0.0000,  0.0000,  0.0000],
        #         [-0.7071, -0.7071, -0.7071], [ 0.7071,  0.7071,  0.7071]])
    """

    def __init__(self, config: GRPOEstimatorConfig | None, context: RunContext | None):
        self.config = config or GRPOEstimatorConfig()

    def compute_advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                           **extras: Any) -> torch.Tensor:
        valid = extras.get("valid_mask")
        advantages = grpo_advantages(rewards, group_ids, normalize_rewards=self.config.normalize_rewards,
                                     leave_one_out=self.config.use_leave_one_out_baseline,
                                     valid_mask=None if valid is None else valid.to(rewards.dtype))
        return advantages[:, None].expand(mask.shape).contiguous()
