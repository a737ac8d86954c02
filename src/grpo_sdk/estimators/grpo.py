"""GRPO advantages: reward minus a per-group baseline, optionally divided by the group std.

The math follows NeMo-RL's ``calculate_baseline_and_std_per_prompt`` and ``GRPOAdvantageEstimator``
(restated in docs/algorithms.md, Estimators and Numerics), vectorised over groups instead
of a Python loop over prompts:

* group-mean baseline: ``b = mean of the group's valid rewards``, ``std`` = unbiased std;
* leave-one-out: ``b_i`` = mean of the *other* valid rows, ``std_i`` = their unbiased std, so
  a 2-row group is never std-normalised and a lone success keeps its raw advantage;
* a group with at most one valid row gets ``b_i = r_i`` (advantage 0) and std 0;
* ``A = (r - b) / (std + 1e-6)`` only where ``std > 0``; rows with zero std keep ``r - b``.

Numerics (NeMo-RL differs here, see docs/decisions.md): the statistics are float64 two-pass
moments on deviations (``grpo_sdk.algorithms.statistics``), each row's leave-one-out statistics
taken over its peers directly. A row whose peers are identical gets std exactly 0 and keeps
``r - b``, where ``E[x^2] - E[x]^2`` leaves rounding noise that the ``1e-6`` epsilon then
amplifies up to a million-fold. The result is rounded to the rewards' dtype once, at the end.
"""

from __future__ import annotations

import torch

from grpo_sdk.estimators.specs import GRPOEstimatorConfig
from grpo_sdk.plugins import AdvantageInput, RunContext
from grpo_sdk.plugins.tensors import GroupLayout, shifted_moments
from grpo_sdk.plugins.toolkit import advantage_input


def group_statistics(rewards: torch.Tensor, group_ids: torch.Tensor, valid_mask: torch.Tensor | None = None,
                     *, leave_one_out: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row float64 ``(advantage, baseline, std)``: ``advantage = r - baseline``, unnormalised.

    The advantage is computed in the shifted frame of ``grpo_sdk.algorithms.statistics``
    (``(r - ref) - offset``), so it is exact where the baseline is: a row whose peers all equal
    ``c`` gets exactly ``r - c``, and a group of equal rewards exactly 0.
    """
    n = len(rewards)
    layout = GroupLayout(group_ids, n)
    valid = torch.ones(n, dtype=torch.float64, device=rewards.device) if valid_mask is None else valid_mask.double()
    peers = layout.peers(valid, leave_one_out)
    r = rewards.double()
    grid = layout.grid(r)[layout.group]
    ref, offset, sum_sq, count = shifted_moments(grid, peers)
    baseline = ref + offset
    advantage = (r - ref) - offset
    std = torch.where(count > 1, (sum_sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sum_sq))

    n_valid = layout.grid(valid).sum(-1)[layout.group]
    if leave_one_out:
        # An invalid row's peers are every valid row of its group; NeMo-RL still divides their sum by
        # n_valid - 1 (its test pins the value). The row is out of the loss, so only parity matters.
        own_invalid = valid <= 0
        quirk = n_valid / (n_valid - 1).clamp(min=1)
        baseline = torch.where(own_invalid, baseline * quirk, baseline)
        advantage = torch.where(own_invalid, r - baseline, advantage)
        std = torch.where(own_invalid, torch.zeros_like(std), std)
    alone = n_valid <= 1  # no valid peer to compare with: advantage 0, as NeMo-RL
    baseline = torch.where(alone, r, baseline)
    advantage = torch.where(alone, torch.zeros_like(advantage), advantage)
    std = torch.where(alone, torch.zeros_like(std), std)
    return advantage, baseline, std


def baseline_and_std_per_group(rewards: torch.Tensor, group_ids: torch.Tensor, valid_mask: torch.Tensor | None = None,
                               *, leave_one_out: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(baseline, std)`` of each row's group, both ``[B]`` in the rewards' dtype."""
    if rewards.numel() == 0:
        return rewards.clone(), rewards.clone()
    _, baseline, std = group_statistics(rewards, group_ids, valid_mask, leave_one_out=leave_one_out)
    return baseline.to(rewards.dtype), std.to(rewards.dtype)


def grpo_advantages64(rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_rewards: bool = True,
                      leave_one_out: bool = True, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``grpo_advantages`` before the final rounding to the rewards' dtype (float64)."""
    if rewards.numel() == 0:
        return rewards.double()
    advantage, _, std = group_statistics(rewards, group_ids, valid_mask, leave_one_out=leave_one_out)
    if normalize_rewards:
        advantage = torch.where(std > 0, advantage / (std + 1e-6), advantage)
    return advantage


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_rewards: bool = True,
                    leave_one_out: bool = True, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row ``[B]`` GRPO advantages in the rewards' dtype (computed in float64, rounded once)."""
    return grpo_advantages64(rewards, group_ids, normalize_rewards=normalize_rewards, leave_one_out=leave_one_out,
                             valid_mask=valid_mask).to(rewards.dtype)


class GRPOEstimator:
    """Example::

        est = GRPOEstimator(GRPOEstimatorConfig(use_leave_one_out_baseline=False), context=None)
        est.compute_advantages(AdvantageInput(rewards=torch.tensor([2., 2., 1., 3.]),
                                              group_ids=torch.tensor([0, 0, 1, 1]), mask=torch.ones(4, 3)))
        # tensor([[ 0.0000,  0.0000,  0.0000], [ 0.0000,  0.0000,  0.0000],
        #         [-0.7071, -0.7071, -0.7071], [ 0.7071,  0.7071,  0.7071]])
    """

    def __init__(self, config: GRPOEstimatorConfig | None, context: RunContext | None):
        self.config = config or GRPOEstimatorConfig()

    @advantage_input
    def compute_advantages(self, batch: AdvantageInput) -> torch.Tensor:
        rewards, group_ids, mask = batch.rewards, batch.group_ids, batch.mask
        valid = batch.valid_mask
        advantages = grpo_advantages(rewards, group_ids, normalize_rewards=self.config.normalize_rewards,
                                     leave_one_out=self.config.use_leave_one_out_baseline,
                                     valid_mask=None if valid is None else valid.to(rewards.dtype))
        return advantages[:, None].expand(mask.shape).contiguous()
