"""What both vLLM engines (``LLM``, generation.py, and ``AsyncLLM``, async_engine.py) send and read
back: the engine's arguments, each row's sampling, prompts as token-id rows, responses packed into
the padded tensors of a ``GenerationOutput``.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_sdk.backends.vllm import lora
from grpo_sdk.backends.vllm.config import VLLMConfig
from grpo_sdk.plugins import GenerationInput, RunContext, SamplingParams


def engine_args(config: VLLMConfig, context: RunContext) -> dict[str, Any]:
    """The engine's arguments, the same for ``LLM`` and ``AsyncLLM`` (async_engine.py)."""
    cfg = context.config
    args: dict[str, Any] = dict(
        model=context.model_path, tokenizer=context.tokenizer_path, seed=context.seed,
        dtype=config.precision or cfg.policy.precision,
        max_model_len=config.max_model_len or cfg.policy.max_total_sequence_length,
        tensor_parallel_size=config.tensor_parallel_size, pipeline_parallel_size=config.pipeline_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization, enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching, enable_sleep_mode=config.enable_sleep_mode,
        logprobs_mode="processed_logprobs",
    )
    if config.kv_cache_memory_bytes:
        args["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    if lora.uses_adapters(cfg):  # policy.lora.sync=adapter: adapters loaded per weight version (lora.py)
        args.update(lora.engine_args(cfg))
    return args


def sampling_params(sampling: SamplingParams, row: int, prompts: GenerationInput | None = None, **extra: Any) -> Any:
    """vLLM's ``SamplingParams`` for row ``row`` of a call: the row's own budget and seed where the
    call gives them (``GenerationInput.max_new_tokens`` / ``seeds``), else a seeded call seeds each
    row its own way."""
    from vllm import SamplingParams as VLLMSampling

    seed = None if sampling.seed is None else sampling.seed * 1_000_003 + row
    budget = sampling.max_new_tokens
    if prompts is not None and prompts.seeds is not None:
        seed = int(prompts.seeds[row])
    if prompts is not None and prompts.max_new_tokens is not None:
        budget = max(1, min(budget, int(prompts.max_new_tokens[row])))  # vLLM decodes at least one token
    return VLLMSampling(
        n=1, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k else -1, max_tokens=budget,
        stop_token_ids=list(sampling.stop_token_ids), logprobs=0, detokenize=False, seed=seed,
        ignore_eos=sampling.ignore_eos, **extra)


def prompt_rows(prompts: GenerationInput) -> list[list[int]]:
    """The left-padded prompts as lists of token ids, padding removed."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]


def pack_rows(tokens: list[list[int]], logprobs: list[list[float]], pad_token_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ``response_ids``, ``logprobs`` and ``response_lengths`` of the rows."""
    width = max((len(t) for t in tokens), default=0)
    response_ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    response_logprobs = torch.zeros((len(tokens), width), dtype=torch.float32)
    for i, (row, row_logprobs) in enumerate(zip(tokens, logprobs)):
        response_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        response_logprobs[i, :len(row)] = torch.tensor(row_logprobs, dtype=torch.float32)
    return response_ids, response_logprobs, torch.tensor([len(t) for t in tokens], dtype=torch.long)
