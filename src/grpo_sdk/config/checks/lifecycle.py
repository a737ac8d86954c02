"""Data, validation and checkpointing: where the prompts come from, when the run validates and
stops, how it saves and ranks checkpoints, and the metric names those settings refer to."""

from __future__ import annotations

import difflib
import re
import string
from typing import Any

from grpo_sdk.config import schema as C
from grpo_sdk.config.checks.components import capabilities_of
from grpo_sdk.core.capabilities import Capability


def check_lifecycle(cfg: C.MasterConfig, registry: Any) -> list[tuple[str, str]]:
    """Data, validation and checkpointing."""
    grpo, data, ckpt, problems = cfg.grpo, cfg.data, cfg.checkpointing, []
    info = registry.info("environment", cfg.env.name) if registry is not None else None
    generates = Capability.GENERATES_PROMPTS in capabilities_of(registry, "environment", cfg.env.name)
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
