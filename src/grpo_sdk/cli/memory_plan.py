"""The run plan's memory estimate: the peak resident memory of a run on the local runtime, part by part.

A run's process holds, from start to end, the framework (``process``), the policy's weights, and
once it has trained, its gradients (set to None only when the next step trains) and the AdamW
moments; a reference model for the KL penalty, a teacher, the generation's own copy of the model
when it does not share the policy's. On top of that, each phase of a step needs memory of its own,
and the peak is the larger of the two:

* training one micro-batch: the activations autograd saves in every decoder layer for backward
  (all of them at the end of the forward pass; with ``policy.hf.gradient_checkpointing`` only each
  layer's input, plus one layer recomputed), and one chunk of LM-head logits
  (``policy.logprob_chunk_size``; backends/hf/forward.py) with its log-softmax temporaries;
* sampling: the KV cache of every row at once, ``rows x (prompt + max_new_tokens) x layers x 2 x
  kv_heads x head_dim`` values.

Under ``policy.hf.autocast`` both phases also hold a bfloat16 copy of every trained weight
(torch.autocast caches the cast of a weight that requires grad for the whole autocast region).

The activation figure is ``a x hidden + b x intermediate`` bytes per token per layer: the
coefficients were counted with ``torch.autograd.graph.saved_tensors_hooks`` on transformers' models
(2026-12-06, transformers 5.25, SDPA attention, which keeps no ``length x length`` matrix), and
tests/unit/test_memory_plan.py counts them again on models of other shapes. ``PROCESS_BYTES`` is measured
(benchmarks/memory_plan.py): Python with torch, transformers and the trainer imported, after a few
steps of a tiny model (the kernels' code pages, the allocator's first pools). Sequence lengths are
the longest the run can see: the longest prompt when ``--dry-run`` tokenized the data (else the
config's bound) plus ``max_new_tokens``. docs/benchmarks.md#memory-plan compares the estimate with
measured peaks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo_sdk.cli.model_size import ModelSize, _cached_config, _read_config
from grpo_sdk.core.builtin_models import BUILTIN_MODELS

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_MOMENT_BYTES = 2 * 4  # exp_avg and exp_avg_sq, counted in fp32


def adam_moment_bytes(cfg: MasterConfig) -> int:
    """Bytes of AdamW state per trained parameter: two moments, in policy.optimizer.moments_dtype."""
    return ADAM_MOMENT_BYTES // (2 if cfg.policy.optimizer.moments_dtype == "bfloat16" else 1)
PROCESS_BYTES = 367 * 2**20  # measured 2026-12-06: 246 MiB once imported, 367 MiB after a tiny model's steps
# Bytes autograd saves per token per decoder layer, as (x hidden size, x intermediate size), float32
# and under bf16 autocast (where the norms and the residual stream stay float32). Fitted to the
# slope of the saved bytes between 64 and 192 tokens on four Llama shapes (hidden 96-576; within 4%
# of each) and three GPT-2 widths (exact), eval mode as the policy runs, SDPA attention.
ACTIVATION_BYTES = {("llama", False): (47.5, 13.1), ("llama", True): (39.9, 6.6),
                    ("gpt2", False): (42.5, 20.0), ("gpt2", True): (26.5, 10.0)}
LOG_SOFTMAX_COPIES = 3  # a chunk's logits and about two temporaries of their size (forward.py)
DEFAULT_LOGITS_CHUNK_BYTES = 64 * 2**20  # backends/hf/forward.py's LOGITS_CHUNK_BYTES


@attrs.frozen(kw_only=True)
class ModelShape:
    family: str  # "llama" or "gpt2": a key of ACTIVATION_BYTES
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def lora_parameters(self, rank: int) -> int:
        """Adapter parameters when every linear layer of the blocks is adapted (peft's all-linear):
        rank x (in + out) per layer."""
        d, inner, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + inner) + (inner + d) if self.family == "llama"
                     else (d + 3 * d) + (d + d) + 2 * (d + inner))  # gpt2: c_attn, attn c_proj, c_fc, mlp c_proj
        return rank * per_layer * self.layers


def model_shape(name: str) -> ModelShape | None:
    """The decoder's shape from the model's config (built in, a local directory, or the hub cache);
    None for an architecture without activation coefficients or a config that lacks a size."""
    if name.startswith("builtin:"):
        facts = BUILTIN_MODELS.get(name.removeprefix("builtin:"))
        config = facts.config_json() if facts is not None else {}
    elif Path(name).expanduser().is_dir():
        config = _read_config(Path(name).expanduser() / "config.json")
    else:
        cached = _cached_config(name)
        config = _read_config(cached) if cached is not None else {}
    try:
        if config.get("model_type") == "gpt2":
            d = config.get("n_embd", 768)
            heads = config.get("n_head", 12)
            return ModelShape(family="gpt2", layers=config.get("n_layer", 12), hidden=d,
                              intermediate=config.get("n_inner") or 4 * d, heads=heads, kv_heads=heads,
                              head_dim=d // heads, vocab=config.get("vocab_size", 50257))
        if config.get("model_type") in ("llama", "mistral", "qwen2", "qwen3"):
            d, heads = config["hidden_size"], config["num_attention_heads"]
            return ModelShape(family="llama", layers=config["num_hidden_layers"], hidden=d,
                              intermediate=config["intermediate_size"], heads=heads,
                              kv_heads=config.get("num_key_value_heads") or heads,
                              head_dim=config.get("head_dim") or d // heads, vocab=config["vocab_size"])
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return None


def activation_bytes_per_token(shape: ModelShape, autocast: bool) -> float:
    """What autograd keeps for backward, per token, summed over the decoder layers."""
    a, b = ACTIVATION_BYTES[(shape.family, autocast)]
    return shape.layers * (a * shape.hidden + b * shape.intermediate)


@attrs.frozen(kw_only=True)
class Lengths:
    prompt: int  # the longest prompt, in tokens
    known: bool  # measured on the data (True) or the config's bound (False)
    new: int  # policy.generation.max_new_tokens
    sequence: int  # the longest prompt + response


def lengths(cfg: MasterConfig, longest_prompt: int | None) -> Lengths:
    policy = cfg.policy
    new = policy.generation.max_new_tokens
    bound = min(cfg.data.max_input_seq_length or policy.max_total_sequence_length - new,
                policy.max_total_sequence_length - new)
    prompt = min(longest_prompt, bound) if longest_prompt is not None else bound
    return Lengths(prompt=prompt, known=longest_prompt is not None, new=new,
                   sequence=min(policy.max_total_sequence_length, prompt + new))


def _hf_options(cfg: MasterConfig, name: str) -> Any:
    blocks = getattr(cfg.policy, "structured_blocks", None) or {}
    return blocks.get(name)


def _shares_model(cfg: MasterConfig) -> bool:
    if cfg.policy.generation.backend != "hf":
        return False
    from grpo_sdk.backends.hf.config import shares_policy_model  # light: config checks, no torch

    blocks = getattr(cfg.policy.generation, "structured_blocks", None) or {}
    return shares_policy_model(cfg, blocks.get("hf"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


LABELS = {"process": "process", "weights": "policy weights", "gradients": "gradients", "adamw_moments": "AdamW moments",
          "lora_adapters": "LoRA adapters", "reference_model": "reference model", "teacher_model": "teacher model",
          "generation_weights": "generation weights", "autocast_copies": "autocast copies",
          "activations": "activations", "logits": "logits", "kv_cache": "KV cache", "total": "total (peak)"}


def estimate(cfg: MasterConfig, model: ModelSize, *, teacher: ModelSize | None = None, teacher_width: int = 4,
             longest_prompt: int | None = None) -> tuple[dict[str, int], list[str]]:
    """``(part -> bytes, the plan's lines)``; ``total`` is the process, what lives through the run,
    and the larger of the training and the sampling phase."""
    policy, params = cfg.policy, model.params
    if params is None:
        return {}, ["not estimated: the parameter count is unknown (see model)"]
    shape = model_shape(policy.model_name)
    hf = _hf_options(cfg, "hf")
    autocast = bool(hf is not None and hf.autocast and policy.backend == "hf")
    parts, notes = _states(cfg, params, shape, teacher, teacher_width)
    lines_after: list[str] = []
    if shape is None:
        lines_after.append(f"not counted: activations, logits and the KV cache (no shape known for "
                           f"{policy.model_name}'s architecture)")
    else:
        steps = _phases(cfg, shape, lengths(cfg, longest_prompt), autocast=autocast, lora=policy.lora.enabled,
                        params=params)
        for key, (value, note) in steps.items():
            parts[key], notes[key] = value, note
    training = sum(parts.get(k, 0) for k in ("activations", "logits"))
    sampling = parts.get("kv_cache", 0)
    lasting = sum(v for k, v in parts.items() if k not in ("activations", "logits", "kv_cache"))
    parts["total"] = lasting + max(training, sampling)
    notes["total"] = ("the above, with the training phase (activations + logits) or the sampling phase "
                      "(KV cache), whichever is larger")
    lines = [f"{LABELS[key]:<18} {human_bytes(value):>10}" + (f"  {notes[key]}" if key in notes else "")
             for key, value in parts.items()]
    if cfg.cluster.runtime == "ray":
        lines.append("on Ray the parts live in several processes (policy, generation, environment workers), "
                     "each with its own process overhead")
        if cfg.cluster.policy_workers > 1:
            states = parts["weights"] + parts["gradients"] + parts["adamw_moments"] + parts.get("reference_model", 0)
            lines.append(f"policy states per rank: about {human_bytes(states / cfg.cluster.policy_workers)} "
                         f"(FSDP2 shards them over cluster.policy_workers={cfg.cluster.policy_workers})")
    lines.extend(lines_after)
    lines.append("not counted: the environment's own memory (a reward model, worker processes), data loading, and "
                 "freed memory the C allocator keeps (glibc: up to 1.7x this over a long run; "
                 "cluster.malloc_mmap_threshold=1048576 returns it, at ~1.1x the step time); measured runs: "
                 "docs/benchmarks.md#memory-plan")
    return parts, lines


def _states(cfg: MasterConfig, params: int, shape: ModelShape | None, teacher: ModelSize | None,
            teacher_width: int) -> tuple[dict[str, int], dict[str, str]]:
    """What lives through the run: the process, the model's and the optimizer's states, other copies."""
    policy = cfg.policy
    width = DTYPE_BYTES[policy.precision]
    parts: dict[str, int] = {"process": PROCESS_BYTES, "weights": params * width}
    notes = {"process": "Python, torch and transformers, after their first steps (measured)",
             "weights": f"{params:,} x {width} B"}
    lora = policy.lora.enabled
    if lora:  # the base is frozen: the optimizer holds the adapters only
        adapters = shape.lora_parameters(policy.lora.rank) if shape is not None else 0
        parts["gradients"] = parts["adamw_moments"] = 0
        moments = adam_moment_bytes(cfg)  # policy.optimizer.moments_dtype applies to the adapters too
        parts["lora_adapters"] = adapters * (4 + 4 + moments)
        notes["gradients"] = notes["adamw_moments"] = "the base is frozen (policy.lora): the adapters' only"
        notes["lora_adapters"] = (f"{adapters:,} adapter values (rank {policy.lora.rank} on every linear layer) x "
                                  f"(weight and gradient, 4 B each; 2 AdamW moments, {moments} B together)"
                                  if shape is not None else "not counted: the model's shape is unknown")
    else:
        halved = policy.optimizer.moments_dtype == "bfloat16"
        parts["gradients"], parts["adamw_moments"] = params * width, params * adam_moment_bytes(cfg)
        notes["gradients"] = f"{params:,} x {width} B, kept until the next step trains"
        notes["adamw_moments"] = (f"2 x {params:,} x 2 B (bfloat16: policy.optimizer.moments_dtype)" if halved else
                                  f"2 x {params:,} x 4 B (fp32" + (
                                      "; a backend that keeps them in the parameter dtype needs less)" if width < 4
                                      else ")"))
    kl = cfg.loss_fn.reference_policy_kl_penalty
    if kl > 0 and lora:
        notes["weights"] += "; also the reference for the KL penalty (LoRA: the base with the adapters off, no copy)"
    elif kl > 0:
        parts["reference_model"] = params * width
        notes["reference_model"] = f"a frozen copy for the KL penalty (loss_fn.reference_policy_kl_penalty={kl})"
    if teacher is not None and teacher.params is not None:
        parts["teacher_model"] = teacher.params * teacher_width
        notes["teacher_model"] = f"{teacher.params:,} x {teacher_width} B ({teacher.how})"
    if _shares_model(cfg):
        parts["generation_weights"] = 0
        notes["generation_weights"] = "none: the hf generation samples with the policy's module " \
                                      "(policy.generation.hf.share_policy_model)"
    else:
        parts["generation_weights"] = params * width
        notes["generation_weights"] = "the generation engine's own copy" + (
            "" if policy.generation.colocated.enabled else ", on its own devices (colocated.enabled=false)")
    return parts, notes


def _phases(cfg: MasterConfig, shape: ModelShape, length: Lengths, *, autocast: bool, lora: bool,
            params: int) -> dict[str, tuple[int, str]]:
    """The parts that exist only during a phase of the step (and the autocast copies, in both)."""
    policy, grpo = cfg.policy, cfg.grpo
    out: dict[str, tuple[int, str]] = {}
    if autocast and not lora:  # a frozen base weight's cast is not cached: transient, one layer at a time
        out["autocast_copies"] = (params * 2, "bfloat16 copies of the trained weights, cached by torch.autocast "
                                              "while a forward pass runs (policy.hf.autocast)")
    rows = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    micro_rows = min(policy.train_global_batch_size or rows, policy.train_micro_batch_size)
    tokens = micro_rows * length.sequence
    for name in ("sequence_packing", "dynamic_batching"):
        block = getattr(policy, name)
        if block.enabled:
            tokens = block.train_mb_tokens or policy.max_total_sequence_length * policy.train_micro_batch_size
    per_token = activation_bytes_per_token(shape, autocast)
    seq = (f"{length.sequence} tokens (the longest prompt, {length.prompt}, + {length.new} new)" if length.known
           else f"{length.sequence} tokens (the config's bound: prompt length unknown here)")
    checkpointing = _hf_options(cfg, "hf") is not None and _hf_options(cfg, "hf").gradient_checkpointing
    if checkpointing:  # each layer's input kept, one layer's activations rebuilt in backward
        layer_input = shape.hidden * (2 if autocast else 4)
        activations = tokens * (shape.layers * layer_input + per_token / shape.layers)
        how = "each layer's input, and one layer recomputed (policy.hf.gradient_checkpointing)"
    else:
        activations = tokens * per_token
        how = f"{per_token / 2**10:,.0f} KiB a token over {shape.layers} layers"
    out["activations"] = (int(activations), f"a training micro-batch of {micro_rows} rows x {seq}: {how}"
                          + (", bfloat16 autocast" if autocast else ""))
    chunk = policy.logprob_chunk_size or max(1, DEFAULT_LOGITS_CHUNK_BYTES // (4 * shape.vocab))
    positions = min(chunk, micro_rows * length.new)
    out["logits"] = (positions * shape.vocab * 4 * LOG_SOFTMAX_COPIES,
                     f"{positions:,} positions x {shape.vocab:,} float32 values at a time "
                     f"(policy.logprob_chunk_size), x{LOG_SOFTMAX_COPIES} with the log-softmax's temporaries")
    sample_rows = rows
    if grpo.val_period or grpo.val_at_start or grpo.val_at_end:
        sample_rows = max(rows, grpo.max_val_samples * grpo.val_num_generations_per_prompt)
    if policy.generation.backend == "hf" and policy.generation.colocated.enabled:
        value = 2 if autocast else DTYPE_BYTES[policy.precision]
        kv = sample_rows * length.sequence * shape.layers * 2 * shape.kv_heads * shape.head_dim * value
        out["kv_cache"] = (kv, f"{sample_rows} rows x {length.sequence} tokens x {shape.layers} layers x 2 x "
                               f"{shape.kv_heads} kv heads x {shape.head_dim} x {value} B")
    return out
