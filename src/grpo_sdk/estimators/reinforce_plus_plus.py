"""REINFORCE++ advantages: a group-mean baseline, an optional per-token KL in the reward, then batch whitening.

Follows NeMo-RL's ``ReinforcePlusPlusAdvantageEstimator`` (docs/algorithms.md, Estimators;
arXiv:2501.03262). With ``m`` the ``[B, S]`` mask (token mask times sample mask):

1. ``a_i = r_i - mean_{G(i)} r`` when ``minus_baseline`` (the plain group mean, *not* leave-one-out;
   a group with one valid row gets 0), else ``a_i = r_i``; broadcast over the row's tokens;
2. when ``loss_fn.use_kl_in_reward`` and ``beta = loss_fn.reference_policy_kl_penalty`` is not 0,
   token-wise ``a <- a - beta * KL(prev || reference)`` with ``loss_fn``'s KL type and clamps. The
   KL is taken on the input-aligned ``prev_logprobs`` / ``reference_logprobs`` as given, so every
   position (masked or not) gets a value; the loss then zeroes its own KL term for this case;
3. global masked whitening: ``mu = sum(a m) / sum(m)``, ``v = sum((a - mu)^2 m) / sum(m)`` (the
   **biased** variance), ``a <- (a - mu) * rsqrt(max(v, 1e-8))``, in float64 on deviations
   (``grpo_sdk.algorithms.statistics.whiten``), so equal advantages whiten to exactly 0. Masked
   positions are transformed too (not zeroed): the loss masks them; they never enter ``mu``/``v``.

Deliberate deviations from upstream (docs/decisions.md):

* the in-reward KL uses ``loss_fn.kl_input_clamp_value`` / ``kl_output_clamp_value``, the same
  clamps as the KL in the loss; upstream always uses 20 / 10 here, whatever the config says;

and two on inputs upstream mishandles silently:

* a mask with no valid token raises ``ValueError`` (upstream divides by zero and returns NaN
  advantages, which then poison the optimizer step);
* ``use_kl_in_reward`` with ``beta != 0`` but no ``prev_logprobs`` / ``reference_logprobs`` raises
  (upstream silently drops the KL, leaving the run with no KL penalty anywhere).
"""

from __future__ import annotations

import torch

from grpo_sdk.estimators.grpo import grpo_advantages
from grpo_sdk.estimators.specs import ReinforcePlusPlusConfig
from grpo_sdk.plugins import AdvantageInput, RunContext
from grpo_sdk.plugins.tensors import calculate_kl, whiten
from grpo_sdk.plugins.toolkit import LossConfig, advantage_input


class ReinforcePlusPlusEstimator:
    """Example::

        est = ReinforcePlusPlusEstimator(None, context=None)
        est.compute_advantages(AdvantageInput(rewards=torch.tensor([0., 1., 2., 3.]),
                                              group_ids=torch.zeros(4, dtype=torch.long), mask=torch.ones(4, 2)))
        # rows: [-1.3416]*2, [-0.4472]*2, [0.4472]*2, [1.3416]*2
    """

    def __init__(self, config: ReinforcePlusPlusConfig | None, context: RunContext | None):
        self.config = config or ReinforcePlusPlusConfig()
        # The KL-in-reward switch and its coefficient live in the loss block: the same options that,
        # without use_kl_in_reward, put the KL into the loss instead.
        self.loss_config: LossConfig = context.config.loss_fn if context is not None else LossConfig()

    @advantage_input
    def compute_advantages(self, batch: AdvantageInput) -> torch.Tensor:
        rewards, group_ids, mask = batch.rewards, batch.group_ids, batch.mask
        if self.config.minus_baseline:
            valid = batch.valid_mask
            advantages = grpo_advantages(rewards, group_ids, normalize_rewards=False, leave_one_out=False,
                                         valid_mask=None if valid is None else valid.to(rewards.dtype))
        else:
            advantages = rewards
        advantages = advantages[:, None].expand(mask.shape)

        loss = self.loss_config
        beta = loss.reference_policy_kl_penalty
        if loss.use_kl_in_reward and beta != 0:
            prev, reference = batch.prev_logprobs, batch.reference_logprobs
            missing = [name for name, x in (("prev_logprobs", prev), ("reference_logprobs", reference)) if x is None]
            if missing:
                raise ValueError(
                    f"reinforce_plus_plus with loss_fn.use_kl_in_reward needs {' and '.join(missing)} to fold the "
                    f"KL into the reward; the training loop computes them when loss_fn.reference_policy_kl_penalty "
                    f"> 0. Set loss_fn.use_kl_in_reward: false to train without the in-reward KL.")
            kl = calculate_kl(prev, reference, loss.reference_policy_kl_type,
                              loss.kl_input_clamp_value, loss.kl_output_clamp_value)
            advantages = advantages - beta * kl

        if not bool((mask != 0).any()):
            raise ValueError("reinforce_plus_plus cannot whiten advantages: the mask has no valid token (every "
                             "row is empty or dropped by sample_mask); upstream NeMo-RL would return NaN here.")
        # Biased (population) variance over the valid tokens, floored at 1e-8 before the rsqrt, so a
        # batch of equal advantages is only centred (to exactly 0: float64 deviations, divided by the
        # valid count itself as upstream, not count + 1e-8).
        return whiten(advantages, mask, unbiased=False, floor=1e-8).to(advantages.dtype)
