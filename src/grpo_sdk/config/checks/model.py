"""The model and the machine, read without torch: sequence lengths against the model's context,
token ids against its vocabulary, path names no file system holds, and batches larger than this
machine's memory (a warning)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grpo_sdk.config import schema as C
from grpo_sdk.core.builtin_models import BUILTIN_MODELS
from grpo_sdk.core.gguf_cache import cached_model_dir, is_gguf

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
