"""GDPO advantages: one GRPO advantage per reward component, weighted, then whitened over the batch.

Multi-reward training with plain GRPO sums the components first, so a component with a large spread
drowns the others and distinct reward combinations collapse onto the same advantage. GDPO
(arXiv:2601.05242; NeMo-RL's ``GDPOAdvantageEstimator``, docs/algorithms.md, Estimators)
normalises each component inside its group first:

1. the components are the ``reward_components`` extra, taken in the **alphabetical order of their
   names** (so ``reward_weights`` has a fixed meaning); fewer than two is an error;
2. per component ``k``: ``A_k = (r_k - b_k) / (std_k + 1e-6)`` where ``std_k > 0``, else ``r_k - b_k``,
   with the same baseline and std as the ``grpo`` estimator and the configured
   ``use_leave_one_out_baseline`` / ``normalize_rewards``;
3. ``A = sum_k w_k A_k`` (``w`` all 1 when ``reward_weights`` is null);
4. whitening over the whole batch: ``A <- (A - mean A) / std A`` with torch's unbiased std and **no
   epsilon** when that std is > 0, else only ``A <- A - mean A`` (a batch of one row has a NaN std
   and takes this branch, giving 0); float64 on deviations, rounded once at the end;
5. broadcast unmasked over the row's tokens.

The ``rewards`` argument is ignored: the advantage is built from the components alone, so whatever
scalar the loop summed them into (and any weighting that sum used) plays no part.
"""

from __future__ import annotations

import torch

from grpo_sdk.estimators.grpo import grpo_advantages64
from grpo_sdk.estimators.specs import GDPOEstimatorConfig
from grpo_sdk.plugins import AdvantageInput, RunContext
from grpo_sdk.plugins.tensors import whiten
from grpo_sdk.plugins.toolkit import advantage_input


class GDPOEstimator:
    """Example::

        est = GDPOEstimator(GDPOEstimatorConfig(use_leave_one_out_baseline=False), context=None)
        est.compute_advantages(AdvantageInput(
            rewards=torch.zeros(2), group_ids=torch.tensor([0, 0]), mask=torch.ones(2, 3), reward_components={
            "correctness": torch.tensor([1., 1.]), "format": torch.tensor([1., 0.]),
            "integer": torch.tensor([1., -1.])}))
        # rows: [0.7071]*3, [-0.7071]*3
    """

    def __init__(self, config: GDPOEstimatorConfig | None, context: RunContext | None):
        self.config = config or GDPOEstimatorConfig()

    @advantage_input
    def compute_advantages(self, batch: AdvantageInput) -> torch.Tensor:
        rewards, group_ids, mask = batch.rewards, batch.group_ids, batch.mask
        components: dict[str, torch.Tensor] = batch.reward_components
        names = sorted(components)
        if len(names) < 2:
            raise ValueError(
                f"the gdpo estimator needs at least 2 named reward components, but this batch has "
                f"{len(names)}: {names}. Use an environment whose reward has several named components "
                f"(env.reverse_digits.format_weight=0.1 gives 'correct_digits' and 'format'; env.name=reward_functions "
                f"with several functions gives one each), or set grpo.adv_estimator.name to 'grpo' for a single reward.")
        weights = self.config.reward_weights
        if weights is None:
            weights = [1.0] * len(names)
        elif len(weights) != len(names):
            raise ValueError(
                f"grpo.adv_estimator.reward_weights has {len(weights)} entries but the batch has {len(names)} "
                f"reward components {names}; give exactly one weight per component, in that (alphabetical) order.")

        valid = batch.valid_mask
        total: torch.Tensor | None = None
        dtype: torch.dtype | None = None  # of the result: the components' common float dtype
        for name, weight in zip(names, weights):  # a handful of components: the loop is not over samples
            r = components[name]
            if not r.is_floating_point():  # bool/int scores: baselines and stds need a float dtype
                r = r.to(torch.get_default_dtype())
            dtype = r.dtype if dtype is None else torch.promote_types(dtype, r.dtype)
            if r.shape != (len(mask),):
                raise ValueError(f"reward component {name!r} has shape {tuple(r.shape)}, expected ({len(mask)},)")
            part = weight * grpo_advantages64(r, group_ids, normalize_rewards=self.config.normalize_rewards,
                                              leave_one_out=self.config.use_leave_one_out_baseline,
                                              valid_mask=None if valid is None else valid.to(r.dtype))
            total = part if total is None else total + part
        assert total is not None and dtype is not None

        # Whiten over every row of the batch, in float64 on deviations (a constant combination gives
        # exactly 0). Unbiased std, no epsilon: a batch whose combined advantage is constant (std 0)
        # is only centred; a single row has no unbiased std and takes the same branch, giving 0.
        total = whiten(total, unbiased=True).to(dtype)
        return total[:, None].expand(mask.shape).contiguous()
