"""The clipped policy-gradient loss with a KL penalty to the reference policy.

Restates NeMo-RL's ``ClippedPGLossFn`` (shared/research/nemo-rl-reference.md §4) for the options
of ``loss_fn.*`` in ``grpo_sdk.core.config.LossConfig``. Per token, with ``c`` the current, ``p``
the old and ``ref`` the reference logprobs and ``A`` the advantage::

    r        = exp(c - p)
    L_actor  = max(-A * r, -A * clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max))
    L_kl     = beta * KL_type(c, ref)            (score-function weighted, clamped)
    loss     = R(L_actor) + R(L_kl)

``R`` is the global token mean (``token_level_loss``) or the mean over sequences of per-sequence
token means. Both divide by counts of the *whole* global batch (passed in by the policy), so
summing micro-batch losses gives the global-batch loss exactly, whatever the micro-batch size.
When ``prev_logprobs`` is None (one optimizer step per rollout), ``p = sg(c)``: the same values
a separate forward pass would give, without the pass.
"""

from __future__ import annotations

import torch

from grpo_sdk.core.config import LossConfig
from grpo_sdk.core.records import TrainBatch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                global_normalization: torch.Tensor | float | None = None) -> torch.Tensor:
    """``sum(values * mask) / (N + 1e-8)``; masked entries never contribute, even NaN or -inf ones."""
    masked = torch.where(mask > 0, values, torch.zeros_like(values)) * mask
    total = masked.sum() if dim is None else masked.sum(dim)
    count = global_normalization if global_normalization is not None else (
        mask.sum() if dim is None else mask.sum(dim))
    return total / (count + 1e-8)


def calculate_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, kl_type: str = "k3",
                 input_clamp_value: float | None = 20.0, output_clamp_value: float | None = 10.0,
                 importance_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(current || reference) by Schulman's k1/k2/k3 estimators, with clamps."""
    log_ratio = reference_logprobs - logprobs
    if input_clamp_value is not None:
        clamped = log_ratio.clamp(-input_clamp_value, input_clamp_value)
        if importance_weights is not None:  # no gradient through the weight where the input was clamped
            importance_weights = torch.where(clamped != log_ratio, importance_weights.detach(), importance_weights)
        log_ratio = clamped
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    elif kl_type == "k3":
        kl = log_ratio.exp() - 1 - log_ratio
    else:
        raise ValueError(f"unknown KL type {kl_type!r}; expected k1, k2 or k3")
    if importance_weights is not None:
        kl = importance_weights * kl
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


class ClippedPGLoss:
    """Example::

        loss_fn = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0))
        loss, metrics = loss_fn(curr_logprobs, micro_batch, global_valid_seqs=n_seq, global_valid_toks=n_tok)
    """

    def __init__(self, config: LossConfig):
        self.config = config

    def _reduce(self, values: torch.Tensor, token_mask: torch.Tensor, sample_mask: torch.Tensor,
                global_valid_seqs: torch.Tensor, global_valid_toks: torch.Tensor) -> torch.Tensor:
        if self.config.token_level_loss:
            return masked_mean(values, token_mask * sample_mask[:, None], global_normalization=global_valid_toks)
        per_sequence = masked_mean(values, token_mask, dim=-1)
        return masked_mean(per_sequence, sample_mask, global_normalization=global_valid_seqs)

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch, *, global_valid_seqs: torch.Tensor,
                 global_valid_toks: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        curr = logprobs[:, 1:]
        token_mask = batch.token_mask[:, 1:]
        sample_mask = batch.sample_mask
        mask = token_mask * sample_mask[:, None]
        advantages = batch.advantages[:, 1:]
        prev = curr.detach() if batch.prev_logprobs is None else batch.prev_logprobs[:, 1:]
        gen = batch.generation_logprobs[:, 1:]

        def reduce(values: torch.Tensor) -> torch.Tensor:
            return self._reduce(values, token_mask, sample_mask, global_valid_seqs, global_valid_toks)

        def token_mean(values: torch.Tensor) -> float:
            return float(masked_mean(values, mask, global_normalization=global_valid_toks))

        ratio = torch.exp(curr - prev)
        clipped_ratio = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        actor_per_token = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
        actor_loss = reduce(actor_per_token)

        kl_loss = torch.zeros((), device=curr.device)
        beta = cfg.reference_policy_kl_penalty
        if beta:
            weights = torch.exp(curr - curr.detach())  # 1 in value, carries the score-function gradient
            kl = calculate_kl(curr, batch.reference_logprobs[:, 1:], cfg.reference_policy_kl_type,
                              cfg.kl_input_clamp_value, cfg.kl_output_clamp_value, weights)
            kl_loss = reduce(beta * kl)
        loss = actor_loss + kl_loss

        with torch.no_grad():
            clipped = ((ratio < 1.0 - cfg.ratio_clip_min) | (ratio > 1.0 + cfg.ratio_clip_max)).float()
            metrics = {
                "loss": float(loss),
                "actor_loss": float(actor_loss),
                "kl_penalty": float(kl_loss) / beta if beta else 0.0,
                "probs_ratio": token_mean(ratio),
                "probs_ratio_clamped": token_mean(clipped_ratio),
                "clip_fraction": token_mean(clipped),
                "token_mult_prob_error": token_mean(torch.exp((gen - prev).abs() * mask)),
                "approx_entropy": token_mean(-torch.exp(curr - gen) * curr),
            }
        return loss, metrics
