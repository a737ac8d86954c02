"""Rules that span config fields, checked after structuring and before any model is loaded.

Each rule returns a problem naming the keys involved; all problems are reported together. These
replace the seed's bare ``assert``s, which ``python -O`` would have dropped, and several of the
seed's silent no-ops (a switch set where nothing reads it) are errors here.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import string
from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.core import config as C
from grpo_sdk.core.async_checks import async_warnings, check_async
from grpo_sdk.core.episode_checks import check_episodes, episode_warnings
from grpo_sdk.core.builtin_models import BUILTIN_MODELS
from grpo_sdk.core.errors import PluginError
from grpo_sdk.core.gguf_cache import cached_model_dir, is_gguf
from grpo_sdk.core.imports import import_target
from grpo_sdk.core.capabilities import Capability
from grpo_sdk.core.reward_checks import check_reward_penalties


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


# --- the model, read without torch --------------------------------------------------------------

# Keys a Hugging Face config.json gives the context length under (vLLM reads the same list).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")
NO_RESCALE = ("su", "longrope", "llama3", "default")


def model_facts(model_name: str) -> tuple[str, dict[str, Any]] | None:
    """``(where, config)`` of a model whose config is known without torch: a built-in model, a local
    directory with a readable config.json or a GGUF file converted before; None for a hub name (its
    config is not here yet)."""
    if model_name.startswith("builtin:"):
        model = BUILTIN_MODELS.get(model_name.split(":", 1)[1])
        if model is None:
            return None
        return f"built-in model {model_name}", model.config_json()
    if is_gguf(model_name):  # converted before: its directory's config; else unknown until it converts
        directory = cached_model_dir(model_name)
        if directory is None:
            return None
        model_name = str(directory)
    path = Path(model_name).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError, RecursionError):  # unreadable: loading the model reports it properly
        return None
    if not isinstance(data, dict):
        return None
    text = data.get("text_config")  # multimodal models keep the language model's numbers here
    return str(path), ({**data, **text} if isinstance(text, dict) else data)


def context_length(config: dict[str, Any]) -> tuple[str, int] | None:
    """The smallest context key the config gives, scaled by a RoPE extension factor as vLLM does."""
    found = [(key, config[key]) for key in CONTEXT_KEYS
             if isinstance(config.get(key), int) and not isinstance(config[key], bool) and config[key] > 0]
    if not found:
        return None
    key, limit = min(found, key=lambda kv: kv[1])
    rope = config.get("rope_scaling")
    # llama3 and longrope configs already give the extended length; the others give the trained one.
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in NO_RESCALE:
        factor = rope.get("factor")
        if isinstance(factor, (int, float)) and factor > 1:
            base = rope.get("original_max_position_embeddings", limit)
            return f"{key} x rope_scaling.factor", int((base if isinstance(base, int) else limit) * factor)
    return key, limit


NAME_MAX = 255  # bytes in one file name on Linux, macOS and Windows file systems; longer ones raise OSError


def check_paths(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    """Path settings no file system can hold: a name longer than NAME_MAX bytes."""
    paths = [("policy.model_name", cfg.policy.model_name), ("policy.tokenizer.name", cfg.policy.tokenizer.name),
             ("on_policy_distillation.teacher_model", cfg.on_policy_distillation.teacher_model),
             ("data.train_path", cfg.data.train_path), ("data.validation_path", cfg.data.validation_path),
             ("logger.log_dir", cfg.logger.log_dir), ("checkpointing.checkpoint_dir", cfg.checkpointing.checkpoint_dir)]
    paths += [(f"data.datasets[{i}].path", ds.path) for i, ds in enumerate(cfg.data.datasets)]
    problems = []
    for key, value in paths:
        long = [part for part in (value or "").split("/") if len(part.encode("utf-8", "replace")) > NAME_MAX]
        if long:
            problems.append((key, f"has a name of {len(long[0].encode('utf-8', 'replace'))} bytes "
                             f"({long[0][:20]}...); file systems allow at most {NAME_MAX}"))
    return problems


def check_model(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    """Sequence lengths against the model's context and token ids against its vocabulary."""
    name, problems = cfg.policy.model_name, []
    if name.startswith("builtin:"):
        if name.split(":", 1)[1] not in BUILTIN_MODELS:
            return [("policy.model_name", f"unknown built-in model {name!r}; built-ins: "
                     + ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_MODELS)))]
    facts = model_facts(name)
    if facts is None:
        return []
    where, config = facts
    context = context_length(config)
    longest = cfg.policy.max_total_sequence_length
    if context is not None and longest > context[1]:
        problems.append(("policy.max_total_sequence_length",
                         f"{longest} exceeds the model's context: {where} gives {context[0]} = {context[1]} "
                         "(positions past it were never trained, and learned ones do not exist)"))
    vocab = config.get("vocab_size")
    outside = [i for i in cfg.policy.generation.stop_token_ids if isinstance(vocab, int) and i >= vocab]
    if outside:
        problems.append(("policy.generation.stop_token_ids",
                         f"{outside} are not below vocab_size = {vocab} of {where}: the model never samples them, "
                         "so they would never stop a response"))
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
    from grpo_sdk.core.loss_checks import check_loss_config

    loss, grpo, problems = cfg.loss_fn, cfg.grpo, []
    problems += check_loss_config(loss, grpo.seq_logprob_error_threshold)
    rollout_rows = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    if loss.force_on_policy_ratio and cfg.policy.train_global_batch_size not in (None, rollout_rows):
        problems.append(("loss_fn.force_on_policy_ratio",
                         "requires policy.train_global_batch_size == grpo.num_prompts_per_step x "
                         f"grpo.num_generations_per_prompt ({rollout_rows}) or null: one optimizer step per rollout"))
    info = registry.info("estimator", grpo.adv_estimator.name) if registry is not None else None
    capabilities = _capabilities(registry, "estimator", grpo.adv_estimator.name)
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


def check_lifecycle(cfg: C.MasterConfig, registry: Any) -> list[tuple[str, str]]:
    """Data, validation and checkpointing."""
    grpo, data, ckpt, problems = cfg.grpo, cfg.data, cfg.checkpointing, []
    info = registry.info("environment", cfg.env.name) if registry is not None else None
    generates = Capability.GENERATES_PROMPTS in _capabilities(registry, "environment", cfg.env.name)
    if data.use_multiple_dataloader:
        if not data.datasets:
            problems.append(("data.datasets", "is empty, but data.use_multiple_dataloader is true"))
        if data.train_path:
            problems.append(("data.train_path", "is ignored when data.use_multiple_dataloader is true; unset one"))
    elif data.datasets:
        problems.append(("data.datasets", "is set, but data.use_multiple_dataloader is false"))
    elif not data.train_path and info is not None and not generates:
        problems.append(("data.train_path", f"is required: environment {cfg.env.name!r} does not generate prompts"))
    validating = grpo.val_period > 0 or grpo.val_at_start or grpo.val_at_end
    if validating and not data.validation_path and info is not None and not generates:
        # Name only the switches that are on, so the fix is exactly those.
        on = [f"grpo.val_period={grpo.val_period}"] if grpo.val_period > 0 else []
        on += [f"grpo.{key}=true" for key in ("val_at_start", "val_at_end") if getattr(grpo, key)]
        off = ["grpo.val_period=0" if key.startswith("grpo.val_period") else key.replace("=true", "=false")
               for key in on]
        problems.append(("data.validation_path",
                         f"is required when validation is on ({', '.join(on)}): environment {cfg.env.name!r} does "
                         f"not generate prompts; set {' '.join(off)} to train without validation"))
    if grpo.stop_at_validation_metric is not None and grpo.stop_at_validation_threshold is None:
        problems.append(("grpo.stop_at_validation_threshold", "must be set with grpo.stop_at_validation_metric"))
    if grpo.stop_at_validation_metric == "pass_k" and grpo.val_num_generations_per_prompt <= 1:
        problems.append(("grpo.stop_at_validation_metric",
                         "'pass_k' needs grpo.val_num_generations_per_prompt > 1"))
    if grpo.stop_at_validation_metric is not None and grpo.val_period == 0:
        problems.append(("grpo.stop_at_validation_metric", "is checked after each periodic validation, but "
                         "grpo.val_period=0 turns those off, so the run would never stop early"))
    if ckpt.keep_top_k is not None and ckpt.keep_top_k < 1:
        problems.append(("checkpointing.keep_top_k", f"must be >= 1 or null: {ckpt.keep_top_k}"))
    if ckpt.metric_name is not None and not ckpt.metric_name.startswith(("train:", "val:")):
        problems.append(("checkpointing.metric_name", f"{ckpt.metric_name!r} must start with train: or val:"))
    if data.prompt_template is not None:
        problems += [("data.prompt_template", m) for m in template_problems(data.prompt_template)]
    problems += check_hub_options(data)
    if ckpt.checkpoint_must_save_by is not None:
        try:
            parse_duration(ckpt.checkpoint_must_save_by)
        except ValueError as exc:
            problems.append(("checkpointing.checkpoint_must_save_by", str(exc)))
    return problems


def check_hub_options(data: C.DataConfig) -> list[tuple[str, str]]:
    """data.streaming and data.revision apply to hf: datasets only; a stream is read up to data.max_rows."""
    paths = [data.validation_path] + ([ds.path for ds in data.datasets] if data.use_multiple_dataloader
                                      else [data.train_path])
    hub = any((p or "").startswith("hf:") for p in paths)
    problems = []
    for key in ("streaming", "revision", "subset"):
        if getattr(data, key) not in (None, False) and not hub:
            problems.append((f"data.{key}", "applies to hf: datasets only, and no data path here starts with hf:"))
    if data.streaming and data.max_rows is None:
        problems.append(("data.max_rows", "is required with data.streaming=true: the prompts are read whole at "
                         "start-up and the same first rows again on resume, so the stream must be cut"))
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


# --- metric names -------------------------------------------------------------------------------

# Validation reports these itself (GRPOTrainer.validate) plus the environment's own metrics; a step
# logs these (docs/algorithms.md, Metrics) plus the families below, which components extend.
VAL_METRICS = ("accuracy", "avg_length", "num_samples", "pass_k")
TRAIN_METRICS = (
    "loss", "actor_loss", "kl_penalty", "positive_nll_loss", "probs_ratio", "probs_ratio_clamped",
    "probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max", "clip_fraction",
    "token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error", "sampling_importance_ratio",
    "is_oob_ratio", "approx_entropy", "num_valid_samples", "filtered_reward", "dynamic_sampling_num_gen_batches",
    "dynamic_sampling_num_discarded_valid_samples", "trivial_group_fraction", "truncated_fraction",
    "generated_tokens", "max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error",
    "max_seq_mult_prob_error_after_mask", "mean_seq_mult_prob_error_after_mask",
    "min_seq_mult_prob_error_after_mask", "num_masked_seqs_by_logprob_error", "masked_correct_pct", "grad_norm",
    "lr", "reward/mean", "reward/std", "reward/num_failed", "advantages/mean", "advantages/min", "advantages/max",
    "reasoning_equal_to_final_answer_rate", "empty_final_answer_rate", "unwanted_token_rate",
    "malformed_think_tag_rate")
TRAIN_FAMILIES = ("reward/", "env/", "val/", "timing/", "perf/", "advantages/", "response_length/", "generation/",
                  "on_policy_distillation/", "reward_penalties/", "length_penalty/")
TYPO_CUTOFF = 0.85  # 'acuracy' -> 'accuracy' (0.93); an environment's 'pass_1' is not 'pass_k' (0.83)


def _env_metrics(registry: Any, env_name: str) -> tuple[str, ...] | None:
    """The metrics the environment declares (``ComponentSpec.metrics``), or None when it declares none."""
    info = registry.info("environment", env_name) if registry is not None else None
    declared = getattr(info.spec, "metrics", None) if info is not None and info.spec is not None else None
    return tuple(sorted(declared)) if declared else None  # sorted: a frozenset's order changes with the hash seed


# Validation returns bare names ("accuracy", and an environment's "exact_match" without "env/"); the
# logged "val/accuracy" or a "val:" prefix there never matches.
VAL_WRONG_PREFIXES = ("val/", "env/", "val:")


def _metric_verdict(name: str, known: tuple[str, ...], families: tuple[str, ...] = (),
                    wrong_prefixes: tuple[str, ...] = ()) -> str | None:
    """None when ``name`` is known; else the name meant (a typo), or "" when nothing is close."""
    if name in known or name.startswith(families):
        return None
    for prefix in wrong_prefixes:
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=TYPO_CUTOFF)
    return close[0] if close else ""


def check_metrics(cfg: C.MasterConfig, registry: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(problems, warnings) for the metric names that stop a run early or rank its checkpoints.

    A typo of a metric the loop reports is an error with a did-you-mean. A name nothing here knows is
    an error when the environment declares its metrics (``ComponentSpec.metrics``) and a warning when it
    does not: it may be one of the environment's (docs/decisions.md, issue 12)."""
    env, problems, warnings = cfg.env.name, [], []
    declared = _env_metrics(registry, env)
    val_known = VAL_METRICS + (declared or ())

    def judge(key: str, shown: str, name: str, known: tuple[str, ...], families: tuple[str, ...], what: str,
              unknown_is_error: bool, fix: Any) -> None:
        verdict = _metric_verdict(name, known, families, VAL_WRONG_PREFIXES if known is val_known else ())
        if verdict:
            problems.append((key, f"{shown!r} is not {what} (did you mean {fix(verdict)!r}?)"))
        elif verdict == "" and unknown_is_error:
            problems.append((key, f"{shown!r} is not {what}: those are {', '.join(known)}"))
        elif verdict == "" and known is TRAIN_METRICS:
            warnings.append((key, f"{shown!r} is not a training metric grpo-sdk logs; it is found only if a "
                             "plugin component logs it"))
        elif verdict == "":
            warnings.append((key, f"{shown!r} is not one of the validation metrics grpo-sdk reports "
                             f"({', '.join(VAL_METRICS)}); it is found only if environment {env!r} reports it "
                             "(it declares no metrics)"))

    stop = cfg.grpo.stop_at_validation_metric
    if stop is not None:
        judge("grpo.stop_at_validation_metric", stop, stop, val_known, (), "a validation metric",
              declared is not None, lambda n: n)
    metric = cfg.checkpointing.metric_name
    if metric is not None and metric.startswith("val:"):
        judge("checkpointing.metric_name", metric, metric[4:], val_known, (), "a validation metric",
              declared is not None, lambda n: f"val:{n}")
    elif metric is not None and metric.startswith("train:"):
        judge("checkpointing.metric_name", metric, metric[6:], TRAIN_METRICS, TRAIN_FAMILIES, "a training metric",
              False, lambda n: f"train:{n}")
    grpo = cfg.grpo
    ckpt = cfg.checkpointing
    if (metric or "").startswith("val:") and ckpt.enabled and ckpt.keep_top_k is not None and grpo.val_period == 0 \
            and not grpo.val_at_end:
        warnings.append(("checkpointing.metric_name", f"ranks checkpoints by {metric!r}, but validation never runs "
                         "before a save (grpo.val_period=0): keep_top_k keeps the newest instead"))
    return problems, warnings


# --- memory -------------------------------------------------------------------------------------

ROLLOUT_BYTES_PER_TOKEN = 32  # token ids (8), masks, and 4-byte generation/old/reference logprobs and advantages


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not POSIX
        return None


def _size(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def check_memory(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    """Warnings: a batch that cannot fit in this machine's memory. Only a warning, since `config
    validate` may run on another machine than the run; with cluster.address the driver may be elsewhere."""
    total = _physical_memory()
    if cfg.cluster.address or not total:
        return []
    grpo, length = cfg.grpo, cfg.policy.max_total_sequence_length
    multiplier = grpo.batch_multiplier if grpo.use_dynamic_sampling else 1
    batches = [("grpo.num_prompts_per_step", "rollout", grpo.num_prompts_per_step * multiplier
                * grpo.num_generations_per_prompt),
               ("grpo.max_val_samples", "validation", grpo.max_val_samples * grpo.val_num_generations_per_prompt)]
    warnings = []
    for key, what, rows in batches:
        need = rows * length * ROLLOUT_BYTES_PER_TOKEN
        if need > total:
            warnings.append((key, f"the {what} batch of {int(rows):,} rows x policy.max_total_sequence_length="
                             f"{length} needs at least {_size(need)}, more than this machine's {_size(total)}"))
    return warnings


def config_warnings(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """Settings that are allowed but probably not what was meant; printed, never fatal."""
    return check_metrics(cfg, registry)[1] + check_memory(cfg) + async_warnings(cfg) + episode_warnings(cfg, registry)


MAX_TEMPLATE_WIDTH = 10_000  # `{prompt:>99999999999}` would pad every prompt to gigabytes


def template_problems(template: str) -> list[str]:
    """What `str.format_map` would raise on for every row, found before any row is read."""
    try:
        fields = [f for f in string.Formatter().parse(template) if f[1] is not None]
    except ValueError as exc:  # "Single '{' encountered": a literal brace is written {{ or }}
        return [f"{template!r} is not a format string: {exc} (write a literal brace as {{{{ or }}}})"]
    problems = []
    for _, name, spec, conversion in fields:
        if name == "" or name.split(".")[0].split("[")[0].isdigit():
            problems.append(f"{template!r}: positional field {{{name}}} has nothing to fill; name a key, e.g. "
                            "{prompt}")
        if conversion not in (None, "r", "s", "a"):
            problems.append(f"{template!r}: unknown conversion !{conversion} (use !r, !s or !a)")
        if any(int(n) > MAX_TEMPLATE_WIDTH for n in re.findall(r"\d+", spec or "")):
            problems.append(f"{template!r}: format spec {spec!r} pads to more than {MAX_TEMPLATE_WIDTH:,} characters")
    return problems


def check_runtime(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """cluster.*: the Ray runtime's worker counts against the batch and the devices; Ray-only keys
    set for the local runtime. Reads installed metadata only: never imports ray."""
    import importlib.metadata as md

    c, problems = cfg.cluster, []
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    if c.runtime != "ray":
        for key in ("policy_workers", "generation_workers", "env_workers"):
            if getattr(c, key) > 1:
                problems.append((f"cluster.{key}", f"{getattr(c, key)} workers need cluster.runtime=ray (the local "
                                 "runtime runs one of each in this process)"))
        if c.address:
            problems.append(("cluster.address", "is set, but cluster.runtime is local; set cluster.runtime=ray"))
        if c.num_nodes > 1:
            problems.append(("cluster.num_nodes", f"{c.num_nodes} nodes need cluster.runtime=ray"))
        if c.env_gpus_per_worker > 0:
            problems.append(("cluster.env_gpus_per_worker", "needs cluster.runtime=ray: the local runtime runs the "
                             "environment in this process, on the run's device"))
        return problems
    try:
        md.version("ray")
    except md.PackageNotFoundError:
        problems.append(("cluster.runtime", "ray is not installed: pip install 'grpo-sdk[ray]'"))
    n, m = c.policy_workers, c.generation_workers
    if rows % n:
        problems.append(("cluster.policy_workers", f"{n} ranks must divide the rollout batch "
                         f"(grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rows}): each rank "
                         "trains an equal share"))
    global_rows = cfg.policy.train_global_batch_size
    if global_rows is not None and global_rows > 0 and global_rows % n:
        problems.append(("policy.train_global_batch_size", f"{global_rows} must be divisible by "
                         f"cluster.policy_workers ({n}): each rank trains an equal share of every optimizer step"))
    if m > rows:
        problems.append(("cluster.generation_workers", f"{m} replicas for a rollout batch of {rows} rows would leave "
                         "some idle; use at most as many replicas as rows"))
    colocated = cfg.policy.generation.colocated.enabled
    if c.num_nodes > 1 and not c.address:
        problems.append(("cluster.num_nodes", f"{c.num_nodes} nodes need an existing cluster (cluster.address); "
                         "a local Ray cluster has one node"))
    bundles = max(n, m) if colocated else n + m
    if c.num_nodes > bundles:  # each node takes a contiguous block of the bundles (grpo_sdk.runtime.nodes)
        how = ("colocated: max(policy_workers, generation_workers)" if colocated
               else "non-colocated: policy_workers + generation_workers")
        problems.append(("cluster.num_nodes", f"{c.num_nodes} nodes, but the run has {bundles} worker bundle(s) to "
                         f"spread over them ({how}), so some node would stay empty; raise cluster.policy_workers or "
                         "cluster.generation_workers, or lower cluster.num_nodes"))
    env_gpus = env_gpus_needed(c.env_workers, c.env_gpus_per_worker)
    if c.gpus_per_node > 0:
        gpus = c.num_nodes * c.gpus_per_node
        needed = (max(n, m) if colocated else n + m) + env_gpus
        if needed > gpus:
            how = ("colocated: max(policy_workers, generation_workers)" if colocated
                   else "non-colocated: policy_workers + generation_workers, one GPU each")
            if env_gpus:
                how += f", + {env_gpus} for env_workers x env_gpus_per_worker"
            problems.append(("cluster.gpus_per_node", f"{gpus} GPUs (num_nodes x gpus_per_node) are too few: this run "
                             f"needs {needed} ({how})"))
        if c.device == "cpu":
            problems.append(("cluster.device",
                             "is cpu, but cluster.gpus_per_node > 0 reserves GPUs no worker would use"))
    elif c.device == "cuda":
        problems.append(("cluster.gpus_per_node", "is 0, but cluster.device=cuda: Ray workers get GPUs only "
                         "through their bundles; set cluster.gpus_per_node"))
    if env_gpus and c.device == "cpu":
        problems.append(("cluster.env_gpus_per_worker", "is set, but cluster.device=cpu: no worker would use the GPUs"))
    elif env_gpus and c.gpus_per_node == 0:
        problems.append(("cluster.env_gpus_per_worker", f"asks for {env_gpus} GPU(s), but cluster.gpus_per_node is 0 "
                         "(the run's GPU budget); set cluster.gpus_per_node to count the environment's GPUs too"))
    return problems


def env_gpus_needed(workers: int, per_worker: float) -> int:
    """Whole GPUs that ``workers`` environment actors of ``per_worker`` GPUs each occupy: Ray puts a
    fraction on one GPU, so floor(1 / fraction) actors share each."""
    if per_worker <= 0:
        return 0
    if per_worker > 1:
        return workers * math.ceil(per_worker)
    return math.ceil(workers / math.floor(1 / per_worker + 1e-9))


def _capabilities(registry: Any, kind: str, name: str) -> frozenset[Capability]:
    info = registry.info(kind, name) if registry is not None else None
    return info.spec.capabilities if info is not None and info.spec is not None else frozenset()


def check_policy_batching(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """``policy.dynamic_batching`` / ``sequence_packing`` / ``logprob_chunk_size``: one of the two
    switches at a time, budgets that hold the longest row, and a policy backend that declares each
    one set (hf does; megatron does not yet)."""
    policy, problems = cfg.policy, []
    dynamic, packing = policy.dynamic_batching, policy.sequence_packing
    if dynamic.enabled and packing.enabled:
        problems.append(("policy.sequence_packing.enabled", "true together with policy.dynamic_batching.enabled: "
                         "choose one (packing already micro-batches by token budget)"))
    longest = policy.max_total_sequence_length
    for block, name in ((dynamic, "dynamic_batching"), (packing, "sequence_packing")):
        if not block.enabled:
            continue
        for field in ("train_mb_tokens", "logprob_mb_tokens"):
            budget = getattr(block, field)
            if budget is not None and budget < longest:
                problems.append((f"policy.{name}.{field}",
                                 f"{budget} is less than policy.max_total_sequence_length ({longest}): a row that "
                                 "long would not fit a micro-batch (rows are never split)"))
    if registry is None:
        return problems
    capabilities = _capabilities(registry, "policy", policy.backend)
    for on, capability, key in ((dynamic.enabled, Capability.DYNAMIC_BATCHING, "policy.dynamic_batching.enabled"),
                                (packing.enabled, Capability.SEQUENCE_PACKING, "policy.sequence_packing.enabled"),
                                (policy.logprob_chunk_size is not None, Capability.LOGPROB_CHUNKS,
                                 "policy.logprob_chunk_size")):
        if on and capability not in capabilities:
            problems.append((key, f"the {policy.backend!r} policy backend does not implement it (its spec does not "
                             f"declare the {capability.value} capability); unset it or use policy.backend=hf"))
    return problems


def check_lora(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """``policy.lora`` is implemented by the hf policy only; adapter-only weight sync needs a
    generation backend that loads adapters itself (``lora_adapters``: vLLM)."""
    lora = cfg.policy.lora
    if not lora.enabled:
        return []
    problems = []
    if cfg.policy.backend != "hf":
        problems.append(("policy.lora.enabled", f"LoRA is implemented by policy.backend=hf only, not "
                         f"{cfg.policy.backend!r}: set policy.backend=hf or policy.lora.enabled=false"))
    backend = cfg.policy.generation.backend
    if lora.sync == "adapter" and Capability.LORA_ADAPTERS not in _capabilities(registry, "generation", backend):
        problems.append(("policy.lora.sync", "'adapter' (adapter tensors only) needs a generation backend that "
                         f"loads LoRA adapters itself (declares lora_adapters: vllm), not {backend!r}; use "
                         "'merged', which every backend takes"))
    return problems


def check_optimizer(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    """bfloat16 AdamW moments are the hf policy's own optimizer, over plain (unsharded) tensors."""
    if cfg.policy.optimizer.moments_dtype == "float32":
        return []
    if cfg.policy.backend != "hf":
        return [("policy.optimizer.moments_dtype", f"bfloat16 moments are implemented by policy.backend=hf only, "
                 f"not {cfg.policy.backend!r}: use float32")]
    if cfg.cluster.runtime == "ray" and cfg.cluster.policy_workers > 1:
        return [("policy.optimizer.moments_dtype", f"bfloat16 moments need one policy rank (FSDP2 shards the "
                 f"optimizer state as DTensors), not cluster.policy_workers={cfg.cluster.policy_workers}: use float32")]
    return []


def check_weight_sync(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """A transport that declares ``ray_workers`` (it runs code in the Ray workers) needs
    cluster.runtime=ray, except the built-in ``collective`` with a generation engine that receives
    the broadcast itself (``receives_broadcast``: an inference server's weight-update group), which
    the driver serves as rank 0 in one process. What else a transport needs it checks itself
    (``ComponentSpec.check``)."""
    name = cfg.weight_sync.backend
    engine_receives = (name == "collective" and Capability.RECEIVES_BROADCAST in
                       _capabilities(registry, "generation", cfg.policy.generation.backend))
    if (Capability.RAY_WORKERS in _capabilities(registry, "weight_sync", name) and cfg.cluster.runtime != "ray"
            and not engine_receives):
        return [("weight_sync.backend", f"{name!r} moves weights between Ray workers: it needs "
                 "cluster.runtime=ray. In one process use weight_sync.backend=inprocess (or disk)")]
    return []


def selected_components(cfg: Any, prefix: str = "") -> list[tuple[str, str, str, Any]]:
    """``(kind, name, key path of its block, its options)`` of every component the config selects."""
    found = []
    for field in attrs.fields(type(cfg)):
        value = getattr(cfg, field.name)
        if not attrs.has(type(value)):
            continue
        path = f"{prefix}{field.name}"
        slot = getattr(type(value), "__plugin__", None)
        if slot is not None:
            selected = getattr(value, slot.selector)
            for name in (selected if slot.many else [selected]):
                found.append((slot.kind, name, f"{path}.{name}", C.plugin_config(value, name)))
        found += selected_components(value, f"{path}.")
    return found


def check_components(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """Each selected component's own check of its options against the rest of the config
    (``ComponentSpec.check``). A check that raises is reported as that plugin's problem, except a
    ``PluginError``: the component cannot be used here (an engine not installed, no GPU for it),
    raised after the other checks as the selector's problem, so the command exits 3."""
    problems: list[tuple[str, str]] = []
    unusable: list[str] = []
    for kind, name, path, options in selected_components(cfg) if registry is not None else []:
        info = registry.info(kind, name)
        target = getattr(info.spec, "check", None) if info is not None and info.spec is not None else None
        if target is None:
            continue
        try:
            problems += [(key, message) for key, message in import_target(target)(cfg, options, registry)]
        except PluginError as exc:
            unusable.append(f"{path}: {exc}")
        except Exception as exc:  # a plugin's bug must not become a traceback of `config validate`
            problems.append((path, f"the option check of {kind} {name!r} ({target}) failed: "
                             f"{type(exc).__name__}: {exc}"))
    if unusable:
        raise PluginError("\n".join(unusable))
    return problems


def parse_duration(text: str) -> float:
    """Seconds in 'DD:HH:MM:SS' or 'HH:MM:SS'."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{text!r} is not 'DD:HH:MM:SS' or 'HH:MM:SS'")
    values = [int(p) for p in parts]
    if len(values) == 3:
        values.insert(0, 0)
    days, hours, minutes, seconds = values
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def check_config(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """Every cross-field problem of ``cfg``; ``registry`` enables the capability checks."""
    return (check_batch_shape(cfg) + check_paths(cfg) + check_model(cfg) + check_rewards(cfg) + check_algorithm(cfg, registry)
            + check_reward_penalties(cfg)
            + check_lifecycle(cfg, registry) + check_metrics(cfg, registry)[0] + check_runtime(cfg, registry)
            + check_weight_sync(cfg, registry) + check_policy_batching(cfg, registry) + check_lora(cfg, registry)
            + check_optimizer(cfg)
            + check_async(cfg, registry) + check_episodes(cfg, registry)
            + check_components(cfg, registry))
