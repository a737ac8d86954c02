"""The clipped policy-gradient loss with a KL penalty to the reference policy.

Restates NeMo-RL's ``ClippedPGLossFn`` (docs/algorithms.md, The loss) for every option
of ``loss_fn.*`` (``grpo_sdk.config.schema.LossConfig``). Per next-token position, with ``c`` the
current, ``p`` the old ("prev"), ``g`` the generation and ``ref`` the reference logprobs, ``A`` the
advantage and ``sg`` stop-gradient::

    r        = exp(c - p)                  token ratio (PPO)
             = exp(mean_t(c - p))          one ratio per sequence (GSPO)
             = exp(c - sg(c))              force_on_policy_ratio: 1, with the gradient of c
             = c                           disable_ppo_ratio (REINFORCE: the loss is -A * c)
    L        = max(-A * r, -A * clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max))
             = -A * sg(clip(r)) * c        use_cispo
    L        = min(L, -A * ratio_clip_c)   dual clip, only where A < 0
    w        = exp(p - g)                  sampler IS weight; GSPO: exp(SUM_t (p - g)), one per
                                           sequence (the ratio uses the mean, the weight the sum)
    loss     = R(w * L) + R(beta * KL(c, ref)) + mu * NLL(correct rows)

``w`` multiplies ``L`` only with ``use_importance_sampling_correction``, after truncation (``tis``
clamps it to [lo, hi]; ``icepop`` zeroes tokens outside; ``seq-mask-tis`` zeroes sequences whose
geometric-mean weight is outside and keeps raw weights elsewhere). The KL is Schulman's k1/k2/k3
weighted by ``exp(c - sg(c))`` (1 in value, it keeps the score-function gradient) or, with
``use_on_policy_kl_approximation``, by ``exp(c - g)``; ``use_kl_in_reward`` sets beta to 0 here.
``R`` is the token mean over the global batch (``token_level_loss``) or the mean over sequences of
per-sequence token means. Both divide by counts of the *whole* global batch, passed in by the
policy, so micro-batch losses, gradients and metrics sum to the global-batch values. The NLL is
the exception, as upstream: it is normalised by the micro-batch's own count of correct tokens.
When ``prev_logprobs`` is None (one optimizer step per rollout), ``p = sg(c)``.

Masked positions (``token_mask * sample_mask == 0``) are set to 0 in every input before any
arithmetic, so a NaN or inf there reaches neither the loss nor the gradient (upstream would return
NaN). Non-finite values at *valid* positions behave as upstream: IS and KL weights map them to 0,
anything else propagates and the policy stops with ``NonFiniteError``.

Metrics: every value is divided by the global count it refers to (``metric_normalizations``), so
the caller sums micro-batches; keys ending in ``_min``/``_max`` are plain extrema of the
micro-batch (+inf/-inf without a valid token, the identity of min/max) that the caller combines
with min/max; counts (``num_valid_samples``, the filter counts) are raw and sum as they are;
``positive_nll_loss`` is the micro-batch's own mean (upstream's local normalisation). Diagnostics
compare the old and sampler logprobs (``p``, ``g``) and ignore the loss options.

In-loss sequence filter (``seq_logprob_error_in_loss``, needs ``grpo.seq_logprob_error_threshold``):
rows whose ``mean_t exp(|g - sg(c)|)`` exceeds the threshold leave this call's ``sample_mask``
(``batch.sample_mask`` is untouched), but the loss still divides by the ORIGINAL global counts, as
upstream does. Which rows survive depends on every micro-batch's forward pass, so no micro-batch
can know the survivor count when its loss is built; the only exact scheme is upstream's: after the
last backward of an optimizer step, multiply the accumulated gradients by
``original_tokens / surviving_tokens`` (before clipping). ``requires_survivor_normalization`` says
when; ``survivor_normalization`` returns that factor and the metrics rescaled to the survivors.
"""

from __future__ import annotations

import math

import torch

from grpo_sdk.config.checks.loss import TIS_TYPES, check_loss_config
from grpo_sdk.algorithms.rewards import seq_logprob_errors
from grpo_sdk.config.schema import LossConfig
from grpo_sdk.core.errors import ConfigError
from grpo_sdk.core.records import TrainBatch

FILTER_COUNTS = ("seq_logprob_error_valid_tokens", "seq_logprob_error_valid_seqs", "num_masked_seqs_by_logprob_error")


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
    """Per-token KL(current || reference) by Schulman's k1/k2/k3 estimators, with clamps.

    With ``l = ref - logprobs``: k1 = -l, k2 = l^2 / 2, k3 = e^l - 1 - l. The weight multiplies
    before the output clamp; where either clamp bites, no gradient flows through KL or weight.
    """
    if kl_type not in _KL_ESTIMATORS:
        raise ValueError(f"unknown KL type {kl_type!r}; expected k1, k2 or k3")
    estimate = _KL_ESTIMATORS[kl_type]
    log_ratio = reference_logprobs - logprobs
    if input_clamp_value is not None:
        clamped = log_ratio.clamp(-input_clamp_value, input_clamp_value)
        if importance_weights is not None:  # no gradient through the weight where the input was clamped
            importance_weights = torch.where(clamped != log_ratio, importance_weights.detach(), importance_weights)
        log_ratio = clamped

    def weighted(x: torch.Tensor) -> torch.Tensor:
        return estimate(x) if importance_weights is None else importance_weights * estimate(x)

    kl = weighted(log_ratio)
    if output_clamp_value is None:
        return kl
    if input_clamp_value is not None:
        return kl.clamp(-output_clamp_value, output_clamp_value)
    # Unclamped inputs can overflow (k3: exp(l) is inf in float32 past l = 88.7) exactly where the output
    # clamp discards the value, and 0 * inf in the backward pass would make the gradient NaN (upstream's
    # does). Those positions take the clamp's value with no gradient, from a harmless recomputation.
    beyond = kl.detach().abs() > output_clamp_value
    harmless = weighted(torch.where(beyond, torch.zeros_like(log_ratio), log_ratio))
    return torch.where(beyond, kl.detach().clamp(-output_clamp_value, output_clamp_value), harmless)


_KL_ESTIMATORS = {
    "k1": lambda log_ratio: -log_ratio,
    "k2": lambda log_ratio: log_ratio.square() / 2,
    "k3": lambda log_ratio: log_ratio.exp() - 1 - log_ratio,
}


class _Means:
    """The reductions of one micro-batch, over inputs already zeroed at masked positions.

    Zeroing first (``torch.where``) is what keeps NaN/inf there out; after it, every value at a
    masked position is finite, so a plain ``sum(x * mask) / (N + 1e-8)`` (upstream's formula)
    is exact and skips a mask comparison and a ``where`` per metric.
    """

    def __init__(self, token_mask, sample_mask, global_valid_toks, global_valid_seqs, token_level: bool):
        self.token_mask, self.sample_mask = token_mask, sample_mask
        self.mask = token_mask * sample_mask[:, None]
        self.valid = self.mask > 0
        self.n_tok, self.n_seq, self.token_level = global_valid_toks, global_valid_seqs, token_level
        self.row_tokens = token_mask.sum(-1)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Mean over the valid tokens of the global batch."""
        return (x * self.mask).sum() / (self.n_tok + 1e-8)

    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``[B]`` token mean of each row (over ``token_mask`` only, as upstream)."""
        return (x * self.token_mask).sum(-1) / (self.row_tokens + 1e-8)

    def sequences(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of a ``[B]`` value over the valid sequences of the global batch."""
        return (x * self.sample_mask).sum() / (self.n_seq + 1e-8)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """``R``: the token mean, or the mean over sequences of per-sequence token means."""
        return self.tokens(x) if self.token_level else self.sequences(self.per_sequence(x))


class ClippedPGLoss:
    """Example::

        loss_fn = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0))
        loss, metrics = loss_fn(curr_logprobs, micro_batch, global_valid_seqs=n_seq, global_valid_toks=n_tok)
    """

    def __init__(self, config: LossConfig, *, seq_logprob_error_threshold: float | None = None):
        problems = check_loss_config(config, seq_logprob_error_threshold)
        if problems:
            raise ConfigError(problems)
        self.config = config
        self.beta = 0.0 if config.use_kl_in_reward else config.reference_policy_kl_penalty
        self.threshold = seq_logprob_error_threshold if config.seq_logprob_error_in_loss else None
        gspo = config.sequence_level_importance_ratios
        like_loss = "tokens" if config.token_level_loss else "sequences"
        # The global count each metric is divided by (the survivor rescale needs it).
        self.metric_normalizations = {
            "loss": like_loss, "actor_loss": like_loss, "kl_penalty": like_loss,
            **dict.fromkeys(("probs_ratio", "probs_ratio_clamped", "clip_fraction", "token_mult_prob_error",
                             "gen_kl_error", "policy_kl_error", "js_divergence_error", "approx_entropy"), "tokens"),
            "sampling_importance_ratio": "sequences" if gspo else "tokens",
            **dict.fromkeys(("num_valid_samples", "positive_nll_loss", "probs_ratio_min", "probs_ratio_max",
                             "probs_ratio_clamped_min", "probs_ratio_clamped_max", *FILTER_COUNTS), "none"),
        }
        if config.truncated_importance_sampling_type is not None:
            seq_mask = config.truncated_importance_sampling_type == "seq-mask-tis"
            self.metric_normalizations["is_oob_ratio"] = "sequences" if seq_mask else "tokens"

    @property
    def requires_survivor_normalization(self) -> bool:
        """True when the caller must apply ``survivor_normalization`` before each optimizer step."""
        return self.threshold is not None

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch, *, global_valid_seqs: torch.Tensor,
                 global_valid_toks: torch.Tensor, unfiltered_logprobs: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics of one micro-batch; ``logprobs`` is input-aligned ``[B, S]`` with grad.

        ``unfiltered_logprobs`` (optional, same layout): logprobs without top-k/top-p filtering,
        used for the KL term only, like upstream's ``curr_logprobs_unfiltered``.
        """
        cfg = self.config
        sample_mask = batch.sample_mask
        counts: dict[str, torch.Tensor] = {}
        if self.threshold is not None:
            errors, _ = seq_logprob_errors(logprobs.detach(), batch.generation_logprobs, batch.token_mask, sample_mask)
            kept = sample_mask * (errors <= self.threshold).to(sample_mask.dtype)  # NaN errors are rejected
            counts["num_masked_seqs_by_logprob_error"] = (sample_mask - kept).sum()
            sample_mask = kept
        means = _Means(batch.token_mask[:, 1:], sample_mask, global_valid_toks, global_valid_seqs, cfg.token_level_loss)
        if counts:
            counts["seq_logprob_error_valid_tokens"] = means.mask.sum()
            counts["seq_logprob_error_valid_seqs"] = sample_mask.sum()

        def clean(x: torch.Tensor) -> torch.Tensor:  # 0 at masked positions, before any arithmetic
            return torch.where(means.valid, x[:, 1:], 0.0)

        curr, gen, adv = clean(logprobs), clean(batch.generation_logprobs), clean(batch.advantages)
        use_curr = cfg.force_on_policy_ratio or batch.prev_logprobs is None
        prev = curr.detach() if use_curr else clean(batch.prev_logprobs)

        kl_term = curr.new_zeros(())
        if self.beta:
            if batch.reference_logprobs is None:
                raise ValueError("loss_fn.reference_policy_kl_penalty > 0 needs batch.reference_logprobs")
            curr_kl = curr if unfiltered_logprobs is None else clean(unfiltered_logprobs)
            kl_weights = torch.exp(curr_kl - (gen if cfg.use_on_policy_kl_approximation else curr_kl.detach()))
            kl_weights = torch.nan_to_num(kl_weights, nan=0.0, posinf=0.0, neginf=0.0)
            kl = calculate_kl(curr_kl, clean(batch.reference_logprobs), cfg.reference_policy_kl_type,
                              cfg.kl_input_clamp_value, cfg.kl_output_clamp_value, kl_weights)
            kl_term = means.loss(self.beta * kl)

        ratio, clipped_ratio = self._ratios(curr, prev, means)
        if cfg.use_cispo:
            per_token = -adv * clipped_ratio.detach() * curr
        else:
            per_token = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        if cfg.ratio_clip_c is not None:
            per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * cfg.ratio_clip_c), per_token)

        weights, is_oob = self._importance_weights(prev, gen, means)
        actor_loss = means.loss(weights * per_token if cfg.use_importance_sampling_correction else per_token)

        nll = curr.new_zeros(())
        mu = cfg.positive_example_nll_weight
        if mu > 0:  # normalised by this micro-batch's correct tokens, as upstream
            correct = means.mask * (batch.rewards > 0).to(means.mask.dtype)[:, None]
            nll = (-curr * correct).sum() / (correct.sum() + 1e-8)
        loss = actor_loss + kl_term + mu * nll

        with torch.no_grad():
            metrics = {"loss": loss, "actor_loss": actor_loss,
                       "kl_penalty": kl_term / self.beta if self.beta else kl_term,
                       **self._ratio_metrics(ratio.detach(), clipped_ratio.detach(), means),
                       **self._mismatch_metrics(prev, gen, means),
                       "sampling_importance_ratio": means.sequences(weights.squeeze(-1))
                       if cfg.sequence_level_importance_ratios else means.tokens(weights),
                       "num_valid_samples": sample_mask.sum(),
                       "approx_entropy": -means.tokens(torch.exp(curr - gen) * curr), **counts}
            if is_oob is not None:
                metrics["is_oob_ratio"] = is_oob
            metrics["positive_nll_loss"] = nll  # 0 when the NLL is off, as upstream logs it
            values = torch.stack([v.detach().reshape(()).double() for v in metrics.values()]).tolist()  # one sync
        return loss, dict(zip(metrics, values))

    def _ratios(self, curr: torch.Tensor, prev: torch.Tensor, means: _Means) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        if cfg.force_on_policy_ratio:
            ratio = torch.exp(curr - curr.detach())  # 1 in value, d ratio / d c = 1
            return ratio, ratio
        if cfg.disable_ppo_ratio:
            return curr, curr
        log_ratio = curr - prev
        if cfg.sequence_level_importance_ratios:
            ratio = torch.exp(means.per_sequence(log_ratio))[:, None].expand_as(curr)
        else:
            ratio = torch.exp(log_ratio)
        return ratio, ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)

    @torch.no_grad()
    def _importance_weights(self, prev: torch.Tensor, gen: torch.Tensor, means: _Means,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Truncated sampler IS weights (``[B, T]``, or ``[B, 1]`` for GSPO) and ``is_oob_ratio``."""
        cfg = self.config
        if cfg.sequence_level_importance_ratios:
            weights = torch.exp(((prev - gen) * means.mask).sum(-1, keepdim=True))
        else:
            weights = torch.exp(prev - gen)
        weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
        hi, kind = cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_type
        if hi is None:
            return weights, None
        lo = cfg.truncated_importance_sampling_ratio_min
        if kind == "tis":
            lo = 0.0 if lo is None else lo
            is_oob = means.tokens(((weights > hi) | (weights < lo)).to(weights.dtype))
            return weights.clamp(lo, hi), is_oob
        if kind == "icepop":
            keep = (weights >= lo) & (weights <= hi)
            return torch.where(keep, weights, 0.0), means.tokens((~keep).to(weights.dtype))
        # seq-mask-tis: the geometric mean of a sequence's token weights decides; kept rows keep raw weights
        log_weights = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
        geo_mean = torch.exp(means.per_sequence(log_weights))
        keep = ((geo_mean >= lo) & (geo_mean <= hi)).to(weights.dtype)
        is_oob = means.sequences(1.0 - keep)
        return weights * keep[:, None], is_oob

    @staticmethod
    def _ratio_metrics(ratio: torch.Tensor, clipped_ratio: torch.Tensor, means: _Means) -> dict[str, torch.Tensor]:
        inf = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)

        def extreme(x: torch.Tensor, low: bool) -> torch.Tensor:
            if x.numel() == 0:
                return inf if low else -inf
            return torch.where(means.valid, x, inf).amin() if low else torch.where(means.valid, x, -inf).amax()

        return {"probs_ratio": means.tokens(ratio), "probs_ratio_clamped": means.tokens(clipped_ratio),
                "probs_ratio_min": extreme(ratio, True), "probs_ratio_max": extreme(ratio, False),
                "probs_ratio_clamped_min": extreme(clipped_ratio, True),
                "probs_ratio_clamped_max": extreme(clipped_ratio, False),
                "clip_fraction": means.tokens((ratio != clipped_ratio).to(ratio.dtype))}

    def _mismatch_metrics(self, prev: torch.Tensor, gen: torch.Tensor, means: _Means) -> dict[str, torch.Tensor]:
        """Trainer vs sampler disagreement: exp|g - p|, KL both ways (no clamps) and Jensen-Shannon."""
        kind = self.config.reference_policy_kl_type
        mixture = torch.logaddexp(prev, gen) - math.log(2.0)  # log(e^p / 2 + e^g / 2), without underflow

        def k3(x: torch.Tensor) -> torch.Tensor:
            return torch.exp(x) - x - 1

        return {"token_mult_prob_error": means.tokens(torch.exp((gen - prev).abs() * means.mask)),
                "gen_kl_error": means.tokens(calculate_kl(gen, prev, kind, None, None)),
                "policy_kl_error": means.tokens(calculate_kl(prev, gen, kind, None, None)),
                "js_divergence_error": means.tokens(0.5 * k3(prev - mixture) + 0.5 * k3(gen - mixture))}

    def zero_gradient_rows(self, batch: TrainBatch) -> torch.Tensor | None:
        """``[B]`` True where a row adds exactly nothing to the loss or its gradient: all its valid
        advantages are 0 (or it has no valid token), so its policy-gradient term is ``-0 * r``. None
        when a term reads every row: the KL penalty, the NLL of correct rows (normalised by the
        micro-batch's own count) or the in-loss filter (its survivor counts)."""
        if self.beta or self.config.positive_example_nll_weight > 0 or self.threshold is not None:
            return None
        valid = (batch.token_mask[:, 1:] * batch.sample_mask[:, None]) > 0
        return ~((batch.advantages[:, 1:] != 0) & valid).any(dim=1)

    def metrics_of_trained_rows(self, metrics: dict[str, float], *, trained_toks: float, trained_seqs: float,
                                global_valid_toks: float, global_valid_seqs: float) -> dict[str, float]:
        """An optimizer step's summed metrics when only some rows ran (``zero_gradient_rows``): the loss
        terms stay as they are (the rows left out add 0 to them), every other mean is rescaled from the
        global counts to the rows trained on."""
        factors = {"tokens": float(global_valid_toks) / trained_toks if trained_toks else 0.0,
                   "sequences": float(global_valid_seqs) / trained_seqs if trained_seqs else 0.0, "none": 1.0}
        exact = ("loss", "actor_loss", "kl_penalty")
        return {k: v if k in exact else v * factors[self.metric_normalizations.get(k, "none")]
                for k, v in metrics.items()}

    def survivor_normalization(self, micro_metrics: list[dict[str, float]], *, global_valid_seqs: float,
                               global_valid_toks: float) -> tuple[float, list[dict[str, float]]]:
        """After the last backward of an optimizer step with the in-loss filter: the factor to
        multiply the accumulated gradients by (before clipping), and each micro-batch's metrics
        rescaled from the original global counts to the survivors'.

        Survivors are summed over the step's micro-batches. With no survivor the gradients are
        all zero and the factor is 0 (upstream raises "No valid response tokens" instead).
        """
        kept_toks = sum(m["seq_logprob_error_valid_tokens"] for m in micro_metrics)
        kept_seqs = sum(m["seq_logprob_error_valid_seqs"] for m in micro_metrics)
        factors = {"tokens": float(global_valid_toks) / kept_toks if kept_toks else 0.0,
                   "sequences": float(global_valid_seqs) / kept_seqs if kept_seqs else 0.0, "none": 1.0}
        rescaled = [{k: v * factors[self.metric_normalizations.get(k, "none")] for k, v in m.items()}
                    for m in micro_metrics]
        return factors["tokens"], rescaled
