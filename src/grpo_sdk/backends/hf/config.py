"""Options of the hf backend (``policy.generation.hf`` and ``policy.hf``), and their checks against
the rest of the config (light: no torch here)."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MAX_TOKENS, require_engine

SHARE_KEY = "policy.generation.hf.share_policy_model"


@attrs.frozen(kw_only=True)
class HFGenerationConfig:
    attn_implementation: Literal["sdpa", "eager"] | None = option(
        None, "Attention kernel passed to from_pretrained; null lets transformers choose.")
    compile: bool = option(False, "torch.compile the sampling forward with a static KV cache, in the whole-batch "
                           "loop: 1.7x faster decoding of a 0.4M-parameter model (2026-12-04) but 1.63x slower on "
                           "SmolLM2-135M under bf16 autocast (2026-12-07; docs/benchmarks.md), after a one-time "
                           "compilation per (batch, prompt width) shape (~20 s on the small model); needs a C++ "
                           "compiler on CPU. Uses SDPA attention.")
    prompt_bucket: int = option(8, "With compile: prompts are left-padded to a multiple of this width, so few "
                                "shapes are compiled.", validator=[attrs.validators.gt(0), attrs.validators.le(MAX_TOKENS)])
    continuous_batching: bool = option(
        True, "Rows leave the decode batch as they finish and waiting rows take their place (at most max_num_seqs "
        "decode at once), the samples of one prompt share its prefill, and each row samples from its own seeded "
        "stream (its tokens do not depend on the rest of the batch). false: the whole-batch loop, which "
        "decodes every row until the longest ends and prefills each row (the loop before issue 35; compile "
        "always uses it, for its static shapes).")
    autocast: Literal["policy", "bfloat16"] | None = option(
        "policy", "Mixed precision of sampling. policy: the autocast the hf policy trains under (policy.hf.autocast), "
        "so the sampler's logprobs are the policy's (token_mult_prob_error near 1); bfloat16: sample under bf16 "
        "autocast whatever the policy does (faster where the CPU has bf16 matrix units; the logprobs then differ "
        "from a float32 policy's by bf16 rounding, as a bf16 vLLM's do); null: no autocast.")
    max_num_seqs: int = option(256, "With continuous_batching: the most rows decoding at once; the others wait and "
                               "are admitted as rows finish.", validator=attrs.validators.gt(0))
    prefix_cache_tokens: int = option(
        8192, "With continuous_batching: keep the KV of finished rows, up to this many tokens (least recently used "
        "out), so a prompt that extends one (a multi-turn episode's next turn) prefills only the new tokens. "
        "Memory: tokens x layers x 2 x KV heads x head size x bytes (SmolLM2-135M under bf16 autocast: 23 KB a "
        "token, 190 MB at 8192). Dropped at finish_generation and on a weight update; 0: off.",
        validator=attrs.validators.ge(0))
    share_policy_model: Literal["auto", True, False] = option(
        "auto", "Sample with the hf policy's own module instead of a second copy of the model: no copy in "
        "memory (a 25M-parameter run's peak RSS drops by about the model's size) and the weight sync copies "
        "nothing (it only bumps the weight version). auto: share whenever it can work (cluster.runtime=local, "
        "policy.backend=hf and generation.backend=hf, colocated, weight_sync.backend=inprocess, no async GRPO, "
        "no compile, one attention kernel); true: share or fail the config check saying why not; false: always a "
        "copy of its own.")


@attrs.frozen(kw_only=True)
class HFPolicyConfig:
    attn_implementation: Literal["sdpa", "eager"] | None = option(
        None, "Attention kernel passed to from_pretrained; null lets transformers choose.")
    gradient_checkpointing: bool = option(
        False, "Recompute each decoder layer's activations in backward instead of keeping them: saves the "
        "activation memory, costs one more forward pass per layer. Measured on CPU at 25M parameters: 0.63x "
        "the step's memory and ~1.2x its time at 8 x 512 tokens, but only 0.91x the memory at 4 x 256, where "
        "gradients and AdamW state set the peak (docs/benchmarks.md#hf-backend-memory-switches).")
    autocast: Literal["bfloat16"] | None = option(
        None, "Mixed precision: forward and backward passes under torch.autocast in this dtype, while the "
        "weights and the AdamW state stay in policy.precision (which must be float32: master weights), so a "
        "small lr still moves them; logprobs are computed in float32 from the logits. A generation sharing "
        "the policy's module (or its own copy) samples under the same autocast. float16 is not offered: it "
        "needs loss scaling.")
    skip_zero_advantage_rows: bool = option(
        False, "Leave rows whose advantages are all 0 (every sample of a group scored alike) out of the training "
        "forward and backward passes, when the loss reads nothing else of them (no KL penalty, no NLL term, no "
        "in-loss logprob-error filter). The loss still divides by the whole batch's counts, so the gradient is "
        "the same up to float summation order; the loss's other metrics then cover the rows trained on "
        "(skipped_zero_advantage_rows counts the rest). Saves the training compute of those rows, most of it "
        "early in a run on a hard task. Not with data-parallel policy workers (ignored there).")


def _policy_options(config: Any) -> Any:
    """The ``policy.hf`` block (defaults when the config has none: a config built in code)."""
    blocks = getattr(config.policy, "structured_blocks", None) or {}
    return blocks.get("hf") or HFPolicyConfig()


def share_blockers(config: Any, options: HFGenerationConfig) -> list[str]:
    """Why an hf generation of this run cannot sample with the hf policy's own module (empty: it can)."""
    reasons = []
    if config.cluster.runtime != "local":
        reasons.append(f"cluster.runtime={config.cluster.runtime}: the policy and the generation live in "
                       "separate processes")
    if config.policy.backend != "hf":
        reasons.append(f"policy.backend={config.policy.backend}: only the hf policy's module can be shared")
    if config.policy.generation.backend != "hf":
        # A plugin subclassing HFGeneration may override update_weights; sharing would skip it unasked.
        reasons.append(f"policy.generation.backend={config.policy.generation.backend}: only the built-in hf "
                       "generation shares the module")
    if not config.policy.generation.colocated.enabled:
        reasons.append("policy.generation.colocated.enabled=false: the generation is to have devices of its own")
    if config.grpo.async_grpo.enabled:
        reasons.append("grpo.async_grpo.enabled=true: async GRPO trains while it samples, so the generation "
                       "needs weights of its own that change only at a weight sync")
    if config.weight_sync.backend != "inprocess":
        reasons.append(f"weight_sync.backend={config.weight_sync.backend}: only the inprocess transport can skip "
                       "the copy")
    if options.compile:
        reasons.append("policy.generation.hf.compile=true: the compiled static-cache forward keeps a model of "
                       "its own")
    policy_attn = _policy_options(config).attn_implementation
    if config.policy.backend == "hf" and policy_attn != options.attn_implementation:
        reasons.append(f"policy.hf.attn_implementation={policy_attn} differs from "
                       f"policy.generation.hf.attn_implementation={options.attn_implementation}: one module has "
                       "one attention kernel")
    return reasons


def shares_policy_model(config: Any, options: HFGenerationConfig | None) -> bool:
    """Whether an hf generation of this run samples with the hf policy's own module."""
    options = options or HFGenerationConfig()
    return options.share_policy_model is not False and not share_blockers(config, options)


def check_generation(config: Any, options: HFGenerationConfig | None, registry: Any) -> list[tuple[str, str]]:
    options = options or HFGenerationConfig()  # a config built without the block: the defaults
    if options.share_policy_model is True:
        blockers = share_blockers(config, options)
        if blockers:
            return [(SHARE_KEY, "true cannot work in this run: " + "; ".join(blockers) +
                     ". Set it to auto (share where it can) or false (a copy of its own)")]
    return []


def check_policy(config: Any, options: HFPolicyConfig | None, registry: Any) -> list[tuple[str, str]]:
    options = options or HFPolicyConfig()  # a config built without the block: the defaults
    # LoRA needs peft: not installed is a PluginError (exit 3) with the install line, before any model
    # loads. The target module names are checked against the model when it is built.
    if config.policy.lora.enabled:
        require_engine("peft", "policy.lora.enabled=true needs it: pip install 'grpo-sdk[lora]'", gpu=False)
    if options.autocast is not None and config.policy.precision != "float32":
        return [("policy.hf.autocast", f"{options.autocast} autocast keeps float32 master weights: it needs "
                 f"policy.precision=float32 (it is {config.policy.precision}, so the weights themselves would be "
                 "low precision and a small lr would not move them). Set policy.precision=float32, or "
                 "policy.hf.autocast=null")]
    return []


def policy_autocast(config: Any) -> str | None:
    """``policy.hf.autocast`` when the policy is the hf backend's, else None: a generation with its own copy
    samples under the autocast the policy trains under, so their logprobs agree."""
    return _policy_options(config).autocast if config.policy.backend == "hf" else None
