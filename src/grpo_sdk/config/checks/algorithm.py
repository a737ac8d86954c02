"""The algorithm's settings against each other: the batch shape, reward scaling and shaping, the
loss options, and what the selected estimator declares it does (``Capability``)."""

from __future__ import annotations

from typing import Any

from grpo_sdk.config import schema as C
from grpo_sdk.config.checks.components import capabilities_of
from grpo_sdk.config.checks.loss import check_loss_config
from grpo_sdk.core.capabilities import Capability


def check_batch_shape(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    problems = []
    rollout_rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    global_rows = cfg.policy.train_global_batch_size
    if global_rows is not None:
        if global_rows <= 0:
            problems.append(("policy.train_global_batch_size", f"must be > 0: {global_rows}"))
        elif rollout_rows % global_rows:
            problems.append(("policy.train_global_batch_size",
                             f"{global_rows} must divide the rollout batch (grpo.num_prompts_per_step x "
                             f"grpo.num_generations_per_prompt = {rollout_rows})"))
    gen = cfg.policy.generation
    if gen.max_new_tokens >= cfg.policy.max_total_sequence_length:
        problems.append(("policy.generation.max_new_tokens",
                         f"{gen.max_new_tokens} leaves no room for a prompt within "
                         f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length}"))
    max_in = cfg.data.max_input_seq_length
    if max_in is not None and max_in + gen.max_new_tokens > cfg.policy.max_total_sequence_length:
        problems.append(("data.max_input_seq_length",
                         f"{max_in} + policy.generation.max_new_tokens={gen.max_new_tokens} exceeds "
                         f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length}"))
    if gen.top_k is not None and gen.top_k < 0:
        problems.append(("policy.generation.top_k", f"must be >= 0 or null: {gen.top_k}"))
    grpo = cfg.grpo
    draw = int(grpo.num_prompts_per_step * grpo.batch_multiplier) if grpo.use_dynamic_sampling else 0
    for key, count, what in [
        ("grpo.num_prompts_per_step", rollout_rows, "grpo.num_prompts_per_step x grpo.num_generations_per_prompt"),
        ("grpo.batch_multiplier", draw * grpo.num_generations_per_prompt,
         "int(grpo.num_prompts_per_step x grpo.batch_multiplier) x grpo.num_generations_per_prompt"),
        ("grpo.max_val_samples", grpo.max_val_samples * grpo.val_num_generations_per_prompt,
         "grpo.max_val_samples x grpo.val_num_generations_per_prompt")]:
        if count > C.MAX_ROWS:
            problems.append((key, f"{what} = {count:,} rows, more than the {C.MAX_ROWS:,} one batch may hold"))
    return problems


def check_rewards(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    grpo, problems = cfg.grpo, []
    scaling, shaping = grpo.reward_scaling, grpo.reward_shaping
    if scaling.enabled and scaling.source_max <= scaling.source_min:
        problems.append(("grpo.reward_scaling.source_max",
                         f"must be greater than grpo.reward_scaling.source_min ({scaling.source_min})"))
    if shaping.enabled:
        coef = shaping.stop_properly_penalty_coef
        if coef is not None:
            if not 0 <= coef <= 1:
                problems.append(("grpo.reward_shaping.stop_properly_penalty_coef", f"must be in [0, 1]: {coef}"))
        else:
            if shaping.overlong_buffer_length is None or shaping.overlong_buffer_length <= 0:
                problems.append(("grpo.reward_shaping.overlong_buffer_length",
                                 "DAPO overlong shaping needs a buffer length > 0 (or set stop_properly_penalty_coef)"))
            if shaping.overlong_buffer_penalty is None or shaping.overlong_buffer_penalty < 0:
                problems.append(("grpo.reward_shaping.overlong_buffer_penalty",
                                 "DAPO overlong shaping needs a penalty >= 0 (or set stop_properly_penalty_coef)"))
            max_length = shaping.max_response_length or cfg.policy.generation.max_new_tokens
            if shaping.overlong_buffer_length and shaping.overlong_buffer_length > max_length:
                problems.append(("grpo.reward_shaping.overlong_buffer_length",
                                 f"{shaping.overlong_buffer_length} exceeds the max response length {max_length}"))
    if grpo.batch_multiplier != 1 and not grpo.use_dynamic_sampling:
        problems.append(("grpo.batch_multiplier",
                         f"{grpo.batch_multiplier} needs grpo.use_dynamic_sampling=true (it must be 1 otherwise)"))
    if grpo.use_dynamic_sampling and int(grpo.num_prompts_per_step * grpo.batch_multiplier) < 1:
        problems.append(("grpo.batch_multiplier", "draws no prompts: num_prompts_per_step x batch_multiplier < 1"))
    low, high = grpo.advantage_clip_low, grpo.advantage_clip_high
    if low is not None and high is not None and low > high:
        problems.append(("grpo.advantage_clip_low", f"{low} is above grpo.advantage_clip_high ({high})"))
    threshold = grpo.seq_logprob_error_threshold
    if threshold is not None and threshold < 1:
        problems.append(("grpo.seq_logprob_error_threshold",
                         f"{threshold} would drop every sample: the error exp(|dlogp|) is at least 1"))
    return problems


def check_algorithm(cfg: C.MasterConfig, registry: Any) -> list[tuple[str, str]]:
    """Loss options against each other, and against the estimator's declared capabilities."""
    loss, grpo, problems = cfg.loss_fn, cfg.grpo, []
    problems += check_loss_config(loss, grpo.seq_logprob_error_threshold)
    rollout_rows = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    if loss.force_on_policy_ratio and cfg.policy.train_global_batch_size not in (None, rollout_rows):
        problems.append(("loss_fn.force_on_policy_ratio",
                         "requires policy.train_global_batch_size == grpo.num_prompts_per_step x "
                         f"grpo.num_generations_per_prompt ({rollout_rows}) or null: one optimizer step per rollout"))
    info = registry.info("estimator", grpo.adv_estimator.name) if registry is not None else None
    capabilities = capabilities_of(registry, "estimator", grpo.adv_estimator.name)
    if info is not None and info.spec is not None:
        if loss.use_kl_in_reward and Capability.KL_IN_REWARD not in capabilities:
            problems.append(("loss_fn.use_kl_in_reward",
                             f"estimator {grpo.adv_estimator.name!r} does not fold a KL into its advantages, so the "
                             "KL penalty would silently vanish; use reinforce_plus_plus or unset it"))
        if loss.seq_logprob_error_in_loss and Capability.PREV_LOGPROBS in capabilities:
            problems.append(("loss_fn.seq_logprob_error_in_loss",
                             f"skips the old-logprob pass that estimator {grpo.adv_estimator.name!r} needs"))
        teacher = cfg.on_policy_distillation.teacher_model
        if Capability.TEACHER_LOGPROBS in capabilities and not teacher:
            problems.append(("on_policy_distillation.teacher_model",
                             f"estimator {grpo.adv_estimator.name!r} needs a teacher model directory"))
        if teacher and Capability.TEACHER_LOGPROBS not in capabilities:
            problems.append(("on_policy_distillation.teacher_model",
                             f"is set, but estimator {grpo.adv_estimator.name!r} uses no teacher "
                             "(select grpo.adv_estimator.name=opd, or unset it)"))
    if grpo.num_generations_per_prompt == 1 and info is not None and uses_group_baseline(cfg, info):
        problems.append(("grpo.num_generations_per_prompt",
                         f"is 1, but estimator {grpo.adv_estimator.name!r} subtracts a baseline taken over each "
                         "prompt's group: with one response per prompt every advantage is 0 and nothing is "
                         "learned; use 2 or more (16 is usual)"))
    if cfg.on_policy_distillation.teacher_model and registry is not None:
        backend = cfg.on_policy_distillation.teacher_backend
        if registry.info("policy", backend) is None:
            problems.append(("on_policy_distillation.teacher_backend", f"no policy backend named {backend!r}"))
    return problems


def uses_group_baseline(cfg: C.MasterConfig, info: Any) -> bool:
    """Estimators declare the ``group_baseline`` capability; reinforce_plus_plus has one only with
    ``minus_baseline`` (a capability cannot depend on the config, so it is read here)."""
    if info.spec is not None and Capability.GROUP_BASELINE in info.spec.capabilities:
        return True
    est = cfg.grpo.adv_estimator
    if est.name == "reinforce_plus_plus" and info.dist == "grpo-sdk":
        return bool(getattr(C.plugin_config(est), "minus_baseline", True))
    return False
