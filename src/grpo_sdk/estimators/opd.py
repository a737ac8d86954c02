"""On-policy distillation (MOPD) advantages: the teacher's minus the student's logprob, per token.

Follows NeMo-RL's ``OPDAdvantageEstimator`` (docs/algorithms.md, Estimators; Eq. 8 of
arXiv:2601.02780). On the student's own samples, a token the teacher finds likelier than the student
does gets a positive advantage, and an unlikely one a negative advantage:

    ``A[b, t] = sg(teacher_logprobs[b, t] - prev_logprobs[b, t]) * mask[b, t]``

* ``prev_logprobs`` are the student's training-engine logprobs (the loop computes them because this
  estimator declares the ``prev_logprobs`` capability), ``teacher_logprobs`` come from
  ``on_policy_distillation.teacher_model``; both are input-aligned ``[B, S]``;
* ``mask`` is the token mask times the sample mask, so filtered rows and padding get exactly 0;
  unlike the reward estimators the result is masked here, because the advantage is per token;
* a teacher shorter than ``S`` (it scored an unpadded batch) is right-padded with zeros; a longer one
  is an error, since truncating would silently misalign tokens;
* rewards and groups are unused: the teacher is the whole learning signal.

``last_metrics`` after each call: ``on_policy_distillation/teacher_student_logprob_gap_mean`` (mean
raw gap over the valid tokens), ``.../adv_mean`` and ``.../adv_std`` (unbiased; 0 with at most one
valid token), all 0 when no token is valid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo_sdk.plugins import AdvantageInput, RunContext
from grpo_sdk.plugins.toolkit import advantage_input

PREFIX = "on_policy_distillation/"


def pad_teacher_logprobs(teacher_logprobs: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Right-pad ``[B, S_t]`` teacher logprobs with zeros to ``[B, seq_len]``; ``S_t > seq_len`` raises."""
    teacher_len = teacher_logprobs.shape[-1]
    if teacher_len > seq_len:
        raise ValueError(f"teacher logprobs have seq length {teacher_len}, longer than the training batch's "
                         f"{seq_len}; the teacher must score the same (input-aligned) tokens as the student")
    return F.pad(teacher_logprobs, (0, seq_len - teacher_len)) if teacher_len < seq_len else teacher_logprobs


class OPDEstimator:
    """Example::

        est = OPDEstimator(None, context=None)
        est.compute_advantages(AdvantageInput(
            rewards=torch.zeros(1), group_ids=torch.zeros(1), mask=torch.tensor([[1., 1., 0.]]),
            teacher_logprobs=torch.zeros(1, 3), prev_logprobs=torch.full((1, 3), -1.)))
        # tensor([[1., 1., 0.]]); est.last_metrics["on_policy_distillation/adv_mean"] == 1.0
    """

    def __init__(self, config: None, context: RunContext | None):
        self.config = config
        self.last_metrics: dict[str, float] = {}

    @advantage_input
    def compute_advantages(self, batch: AdvantageInput) -> torch.Tensor:
        rewards, group_ids, mask = batch.rewards, batch.group_ids, batch.mask
        teacher, prev = batch.teacher_logprobs, batch.prev_logprobs
        if teacher is None:
            raise ValueError("the opd estimator needs teacher_logprobs: set on_policy_distillation.teacher_model "
                             "to the teacher's model directory or checkpoint (same tokenizer as the policy)")
        if prev is None:
            raise ValueError("the opd estimator needs prev_logprobs (the student's training-engine logprobs of the "
                             "sampled tokens); the training loop computes them for estimators declaring the "
                             "prev_logprobs capability")
        teacher = pad_teacher_logprobs(teacher, mask.shape[-1])

        gap = (teacher - prev).detach()  # stop-gradient: the advantage is a fixed target, not a path to the student
        valid = mask != 0
        # where() before the product: a -inf/NaN logprob at a masked position (padding) must give 0, not NaN.
        advantages = torch.where(valid, gap, torch.zeros_like(gap)) * mask

        gap_valid, adv_valid = gap[valid], advantages[valid]
        n = adv_valid.numel()
        self.last_metrics = {
            PREFIX + "teacher_student_logprob_gap_mean": gap_valid.mean().item() if n > 0 else 0.0,
            PREFIX + "adv_mean": adv_valid.mean().item() if n > 0 else 0.0,
            PREFIX + "adv_std": adv_valid.std().item() if n > 1 else 0.0,
        }
        return advantages
