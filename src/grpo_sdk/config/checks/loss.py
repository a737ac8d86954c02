"""Which ``loss_fn`` options go together (light: no torch, so `grpoctl config validate` can run it;
the loss, ``grpo_sdk.algorithms.loss``, checks the same at construction).

NeMo-RL asserts these at loss construction or at the first training step, after models are
loaded; here they are config errors naming the keys, found before anything heavy starts.
"""

from __future__ import annotations

import math

from grpo_sdk.config.schema import LossConfig

TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


def check_loss_config(cfg: LossConfig, seq_logprob_error_threshold: float | None = None) -> list[tuple[str, str]]:
    """Every combination of ``loss_fn`` options the loss cannot run, as ``(path, message)`` pairs.

    Upstream asserts these at construction or at the first call; here they are config errors,
    checked before any model loads.
    """
    problems: list[tuple[str, str]] = []

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            problems.append((key if key.startswith("grpo.") else f"loss_fn.{key}", message))

    need(cfg.reference_policy_kl_type in ("k1", "k2", "k3"), "reference_policy_kl_type", "must be k1, k2 or k3")
    need(math.isfinite(cfg.reference_policy_kl_penalty), "reference_policy_kl_penalty", "must be finite")
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = getattr(cfg, key)
        need(value is None or value > 0, key, f"must be > 0 or null: {value}")
    need(cfg.ratio_clip_c is None or cfg.ratio_clip_c > 1, "ratio_clip_c",
         "must be > 1 (the dual clip caps -A x ratio at -A x c for A < 0) or null")
    need(not cfg.sequence_level_importance_ratios or not cfg.token_level_loss, "sequence_level_importance_ratios",
         "needs loss_fn.token_level_loss=false (GSPO's loss is a mean over sequences)")

    tis, hi, lo = (cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio,
                   cfg.truncated_importance_sampling_ratio_min)
    if tis is None:
        need(hi is None, "truncated_importance_sampling_ratio",
             "is set but loss_fn.truncated_importance_sampling_type is null; set the type or unset the ratio")
    elif tis not in TIS_TYPES:
        need(False, "truncated_importance_sampling_type", f"must be one of {', '.join(TIS_TYPES)} or null")
    else:
        need(cfg.use_importance_sampling_correction, "truncated_importance_sampling_type",
             "needs loss_fn.use_importance_sampling_correction=true")
        need(hi is not None and hi > 0, "truncated_importance_sampling_ratio",
             f"must be > 0 with truncated_importance_sampling_type={tis}")
        need(tis == "tis" or lo is not None, "truncated_importance_sampling_ratio_min", f"must be set for {tis}")
        need(lo is None or hi is None or lo <= hi, "truncated_importance_sampling_ratio_min",
             "must be <= loss_fn.truncated_importance_sampling_ratio")
        need(tis != "seq-mask-tis" or not cfg.sequence_level_importance_ratios, "sequence_level_importance_ratios",
             "must be false with seq-mask-tis (token IS weights, sequence-level masking)")

    if cfg.use_cispo:
        reason = "must be false with use_cispo=true"
        need(not cfg.disable_ppo_ratio, "disable_ppo_ratio", f"{reason}: CISPO weights by the clipped ratio")
        need(not cfg.force_on_policy_ratio, "force_on_policy_ratio", f"{reason}: a ratio of 1 is never clipped")
        need(not cfg.sequence_level_importance_ratios, "sequence_level_importance_ratios",
             f"{reason}: CISPO clips token ratios")
        need(cfg.ratio_clip_c is None, "ratio_clip_c",
             "must be null with use_cispo=true (the dual clip would override CISPO)")
        need(cfg.token_level_loss, "token_level_loss", "must be true with use_cispo=true")

    if cfg.seq_logprob_error_in_loss:
        reason = "must be {} with loss_fn.seq_logprob_error_in_loss=true"
        need(seq_logprob_error_threshold is not None, "grpo.seq_logprob_error_threshold", reason.format("set"))
        need(cfg.force_on_policy_ratio, "force_on_policy_ratio",
             reason.format("true") + " (the training forward stands in for the old-logprob pass)")
        need(cfg.token_level_loss, "token_level_loss", reason.format("true") + " (survivors are rescaled per token)")
        need(cfg.positive_example_nll_weight == 0, "positive_example_nll_weight", reason.format("0"))
        need(not cfg.use_kl_in_reward, "use_kl_in_reward",
             reason.format("false") + " (its KL needs the old-logprob pass this mode skips)")
    return problems
