"""RLOO advantages: each reward minus the mean reward of the *other* rows of its group.

``A_i = r_i - mean_{j in G(i), j != i} r_j`` with no std normalisation, broadcast over the row's
tokens. This is exactly the ``grpo`` estimator with ``use_leave_one_out_baseline: true`` and
``normalize_rewards: false`` (NeMo-RL's ``calculate_baseline_and_std_per_prompt`` in LOO mode,
docs/algorithms.md, Estimators), offered under its own name so a recipe can say what it
means. Equivalently ``A_i = n/(n-1) * (r_i - mean_G r)``: the group-mean advantage scaled by the
group's ``n/(n-1)``, which removes the bias of a baseline that includes the row's own reward.

Edge cases (inherited from the shared baseline helper in ``grpo.py``):

* a group with at most one valid row gets advantage 0 (no other row to compare with);
* a group of identical rewards gets exactly 0;
* rows outside ``valid_mask`` do not enter the other rows' baselines.
"""

from __future__ import annotations

import torch

from grpo_sdk.estimators.grpo import grpo_advantages
from grpo_sdk.plugins import AdvantageInput, RunContext
from grpo_sdk.plugins.toolkit import advantage_input


class RLOOEstimator:
    """Example::

        est = RLOOEstimator(None, context=None)
        est.compute_advantages(AdvantageInput(rewards=torch.tensor([1., 0., 0., 0.]),
                                              group_ids=torch.zeros(4, dtype=torch.long), mask=torch.ones(4, 2)))
        # rows: [1, 1], [-1/3, -1/3], [-1/3, -1/3], [-1/3, -1/3]
    """

    def __init__(self, config: None, context: RunContext | None):
        # RLOO has no options: its whole point is the fixed leave-one-out, unnormalised form.
        self.config = config

    @advantage_input
    def compute_advantages(self, batch: AdvantageInput) -> torch.Tensor:
        rewards, group_ids, mask = batch.rewards, batch.group_ids, batch.mask
        valid = batch.valid_mask
        advantages = grpo_advantages(rewards, group_ids, normalize_rewards=False, leave_one_out=True,
                                     valid_mask=None if valid is None else valid.to(rewards.dtype))
        # Broadcast unmasked, as NeMo-RL does; the loss applies the token mask.
        return advantages[:, None].expand(mask.shape).contiguous()
