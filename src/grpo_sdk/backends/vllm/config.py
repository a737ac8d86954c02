"""Options of the vLLM backend: ``policy.generation.vllm`` (NeMo-RL's ``vllm_cfg`` also works)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs

from grpo_sdk.plugins import option

if TYPE_CHECKING:
    from grpo_sdk.plugins.toolkit import MasterConfig


@attrs.frozen(kw_only=True)
class VLLMConfig:
    tensor_parallel_size: int = option(1, "GPUs one engine shards the model over (tensor parallelism).",
                                       validator=attrs.validators.gt(0))
    pipeline_parallel_size: int = option(1, "Pipeline stages of one engine.", validator=attrs.validators.gt(0))
    gpu_memory_utilization: float = option(0.6, "Fraction of device memory vLLM may take (on the CPU build: of "
                                           "host memory), for weights and KV cache.",
                                           validator=[attrs.validators.gt(0), attrs.validators.le(1)])
    kv_cache_memory_bytes: int | None = option(None, "KV-cache size in bytes; overrides gpu_memory_utilization "
                                               "for the cache (useful on shared CPUs and small GPUs).")
    max_model_len: int | None = option(None, "Longest prompt + response the engine accepts; null uses "
                                       "policy.max_total_sequence_length.")
    enforce_eager: bool = option(False, "Disable CUDA graphs (faster start, slower decode).")
    precision: Literal["auto", "float32", "bfloat16", "float16"] | None = option(
        None, "Engine dtype; null uses policy.precision. Generation logprobs are compared with the policy's, so "
        "a lower precision than the policy's shows up in token_mult_prob_error.")
    enable_sleep_mode: bool = option(False, "Colocated on a GPU: release the engine's memory (weights and KV "
                                     "cache) after each generation round and take it back before the next.")
    enable_prefix_caching: bool = option(True, "Reuse the KV cache of shared prompt prefixes (the G samples of "
                                         "a prompt share all of it).")
    async_engine: bool = option(False, "Drive vLLM's AsyncLLM (its engine core in a process of its own) instead of "
                                "the in-process LLM: requests can be submitted without blocking, paused for a "
                                "weight update and updated while in flight, with each token's weight version "
                                "recorded (async GRPO, docs/vllm.md); grpo.async_grpo.in_flight_weight_updates=true "
                                "needs it. Weights reach it through a safetensors file.")


def check_options(config: MasterConfig, options: VLLMConfig, registry: Any) -> list[tuple[str, str]]:
    """Async GRPO overlaps generation with training, which an engine asleep during training cannot do;
    the async engine has no sleep mode here. The spec declares in_flight_weight_updates for the
    backend, but only the async engine keeps requests in flight across a weight update: the
    in-process ``LLM.generate`` holds its whole batch until every row is done."""
    async_grpo = config.grpo.async_grpo
    problems = []
    if async_grpo.enabled and async_grpo.in_flight_weight_updates and not options.async_engine:
        problems.append(("policy.generation.vllm.async_engine",
                         "must be true with grpo.async_grpo.in_flight_weight_updates=true: only vLLM's async engine "
                         "(AsyncLLM) can freeze its requests between two decode steps for a weight update and record "
                         "which weights sampled each token; the in-process engine finishes its whole batch first. "
                         "Set policy.generation.vllm.async_engine=true, or "
                         "grpo.async_grpo.in_flight_weight_updates=false (a weight update then waits for the "
                         "generation in flight)"))
    if options.enable_sleep_mode and async_grpo.enabled:
        problems.append(("policy.generation.vllm.enable_sleep_mode",
                         "must be false with grpo.async_grpo.enabled=true: a sleeping engine has released its weights "
                         "and KV cache while the policy trains, so it cannot generate the next steps' rollouts "
                         "meanwhile; set policy.generation.vllm.enable_sleep_mode=false"))
    elif options.enable_sleep_mode and options.async_engine:
        problems.append(("policy.generation.vllm.enable_sleep_mode",
                         "must be false with policy.generation.vllm.async_engine=true: sleep mode is implemented for "
                         "the in-process engine only; set one of them to false"))
    lora = config.policy.lora
    if lora.enabled and lora.sync == "adapter":
        if options.async_engine:
            problems.append(("policy.lora.sync", "'adapter' is implemented for vLLM's in-process engine only, not "
                             "policy.generation.vllm.async_engine=true; use policy.lora.sync=merged"))
        if lora.rank > 512:
            problems.append(("policy.lora.rank", f"{lora.rank} is above 512, the largest LoRA rank vLLM loads "
                             "(max_lora_rank); use policy.lora.sync=merged or a smaller rank"))
    return problems
