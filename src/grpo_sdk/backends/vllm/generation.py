"""vLLM generation: an engine in this process, fed token ids, reloaded in place after each step.

* Prompts go in as token ids (``TokensPrompt``) and responses come back as token ids, so what the
  policy scores is exactly what was sampled: no detokenise/retokenise drift.
* ``logprobs_mode="processed_logprobs"`` makes vLLM report the logprob of each sampled token under
  the distribution it sampled from (temperature, top-k, top-p applied), which is what the hf
  policy computes; ``token_mult_prob_error`` near 1 checks it every step.
* The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so new weights are
  loaded with the worker's ``reload_weights(weights_iterator=...)``: no restart, no file. With a
  multi-process engine (tensor parallelism) they go through a safetensors file instead.
* The engine's seed is the run's seed; ``SamplingParams.seed`` (validation) seeds each request.
* ``async_engine: true`` selects ``AsyncLLM`` instead (async_engine.py); what both engines send and
  read back is in engine_inputs.py.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from grpo_sdk.backends.vllm import async_engine, lora
from grpo_sdk.backends.vllm.config import VLLMConfig
from grpo_sdk.backends.vllm.engine_inputs import engine_args, pack_rows, prompt_rows, sampling_params
from grpo_sdk.plugins import GenerationInput, GenerationOutput, PluginError, RunContext, SamplingParams
from grpo_sdk.plugins.toolkit import load_tokenizer

IN_FLIGHT_NEEDS_ASYNC = ("the in-process vLLM engine cannot pause for a weight update in flight: set "
                         "policy.generation.vllm.async_engine=true (or grpo.async_grpo.in_flight_weight_updates=false)")


class VLLMGeneration:
    def __new__(cls, config: VLLMConfig | None = None, context: RunContext | None = None) -> Any:
        # The spec names one class (the contract kit checks it); which engine drives vLLM is a
        # config choice, so async_engine=true constructs the AsyncLLM backend here instead.
        if config is not None and config.async_engine:
            return async_engine.VLLMAsyncGeneration(config, context)
        return super().__new__(cls)

    def __init__(self, config: VLLMConfig | None, context: RunContext):
        config = config or VLLMConfig()
        in_process = config.tensor_parallel_size * config.pipeline_parallel_size == 1
        # In one process vLLM must not fork its engine core. It reads this variable only while it
        # builds the engine, so it is set for the construction and then put back as it was.
        in_process = in_process and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0"
        from vllm import LLM

        with _environ("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else None), lora.model_support():
            self.llm = LLM(**engine_args(config, context))
        self.config = config
        self.in_process = in_process
        tokenizer = load_tokenizer(context.tokenizer_path)
        self.pad_token_id = tokenizer.pad_token_id
        self.weight_version = 0
        self.sleeping = False
        adapters = lora.uses_adapters(context.config)  # policy.lora.sync=adapter
        self.adapter = lora.AdapterSlot(self.llm.llm_engine, context.config) if adapters else None

    # --- sampling -------------------------------------------------------------------------------

    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        from vllm.inputs import TokensPrompt

        rows = prompt_rows(prompts)
        params = [sampling_params(sampling, i, prompts) for i in range(len(rows))]
        request = self.adapter.request if self.adapter is not None else None  # the current adapter
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False,
                                    lora_request=request)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [[entry[token].logprob for token, entry in zip(row, o.outputs[0].logprobs)]
                    for row, o in zip(tokens, outputs)]
        response_ids, response_logprobs, lengths = pack_rows(tokens, logprobs, self.pad_token_id)
        return GenerationOutput(
            response_ids=response_ids, response_lengths=lengths, logprobs=response_logprobs,
            truncated=torch.tensor([o.outputs[0].finish_reason == "length" for o in outputs]),
            weight_version=self.weight_version)

    # --- weights --------------------------------------------------------------------------------

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self.prepare_for_generation()  # a sleeping engine holds no weights to update
        if self.adapter is not None:  # policy.lora.sync=adapter: A and B only, loaded as a LoRA adapter
            self.adapter.load(weights, version)
        elif self.in_process:
            worker = self.llm.llm_engine.model_executor.driver_worker
            worker = getattr(worker, "worker", worker)
            # reload_weights, not the model's load_weights: vLLM's CPU and quantised layers repack
            # weights after loading, and only the reload path redoes that.
            worker.reload_weights(weights_iterator=((n, t.detach()) for n, t in weights))
        else:
            from grpo_sdk.plugins.tensors import write_weights

            with tempfile.TemporaryDirectory(prefix="grpo-vllm-weights-") as tmp:
                write_weights(weights, Path(tmp) / "model.safetensors")
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weight_version = version

    # --- colocation -----------------------------------------------------------------------------

    def prepare_for_generation(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def finish_generation(self) -> None:
        if self.config.enable_sleep_mode:
            self.llm.sleep(level=1)  # level 1: weights to host memory, KV cache dropped
            self.sleeping = True

    def shutdown(self) -> None:
        if self.adapter is not None:
            self.adapter.close()
        self.llm = None

    # --- PausesForRefit -------------------------------------------------------------------------
    # The spec declares in_flight_weight_updates for the backend (one spec, one class), which the
    # async engine delivers; the backend's config check refuses in-flight updates without it, and
    # async GRPO pauses the engine only for them. So only a caller that skipped the check gets here.

    def pause_generation(self, *, keep_in_flight: bool) -> None:
        raise PluginError(IN_FLIGHT_NEEDS_ASYNC)

    def resume_generation(self, *, recompute_kv_cache: bool) -> None:
        raise PluginError(IN_FLIGHT_NEEDS_ASYNC)


@contextlib.contextmanager
def _environ(name: str, value: str | None) -> Iterator[None]:
    """``name=value`` in this process's environment for the block (None: leave it as it is)."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
