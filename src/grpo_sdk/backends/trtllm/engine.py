"""TensorRT-LLM generation in this process: the LLM API, PyTorch backend, Ray-orchestrated workers
(``policy.generation.trtllm.mode: engine``).

Built the way NeMo-RL's ``TrtllmAsyncGenerationWorkerImpl`` builds its engine
(``nemo_rl/models/generation/trtllm/trtllm_worker_async.py``, NVIDIA-NeMo/RL 7ea279ab) and verl's
``TRTLLMHttpServer.launch_server`` (``verl/workers/rollout/trtllm_rollout/trtllm_async_server.py``):
``AsyncLLM(model=..., backend="pytorch", orchestrator_type="ray", ray_worker_extension_cls=<ours>,
kv_cache_config=KvCacheConfig(...), ...)`` then ``await llm.setup_async()``; requests are
``await llm.generate_async(inputs={"prompt_token_ids": ids}, sampling_params=SamplingParams(...))``,
read as ``out.outputs[0].token_ids`` / ``.logprobs`` (one ``{token_id: Logprob}`` dict per token, or
a float) / ``.finish_reason``; worker calls are ``await llm.collective_rpc(method, args=...)`` (a list,
one result per worker); memory is ``await llm.release(tags)`` / ``await llm.resume(tags)``.

Both ``async_engine`` settings drive ``AsyncLLM`` (NeMo-RL's only TensorRT-LLM path): the sync ``LLM``
reaches worker extensions through the private ``_collective_rpc``, which this backend does not use.

Logprobs: TensorRT-LLM reports RAW logprobs by default (``LogprobMode.RAW``); this backend asks for
``LogprobMode.PROCESSED`` (``tensorrt_llm/sampling_params.py``, current main), the distribution the
token was sampled from, which is what the policy computes. A TensorRT-LLM without ``LogprobMode`` is
refused at construction. NOT run here: TensorRT-LLM does not install on this machine; the tests
drive this class against a FAKE ``tensorrt_llm`` module (tests/engine_fakes/fake_tensorrt_llm.py)
and check only that it calls the API as written above.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from grpo_sdk.backends.trtllm.config import TrtllmConfig
from grpo_sdk.backends.trtllm.base import Completion, TrtllmGeneration, row_seeds
from grpo_sdk.backends.trtllm.refit import check_replies, device_uuid, parse_command
from grpo_sdk.plugins import GrpoSdkError, PluginError, RunContext, SamplingParams
from grpo_sdk.plugins.toolkit import background_event_loop

EXTENSION = "grpo_sdk.backends.trtllm.worker_extension.GrpoWorkerExtension"


def engine_kwargs(config: TrtllmConfig, context: RunContext, kv_cache_config: Any) -> dict[str, Any]:
    cfg = context.config
    max_len = config.max_model_len or cfg.policy.max_total_sequence_length
    kwargs: dict[str, Any] = dict(
        model=context.model_path, tokenizer=context.tokenizer_path, backend="pytorch",
        tensor_parallel_size=config.tensor_parallel_size, dtype=config.precision or cfg.policy.precision,
        # max_input_len defaults to 1024 in TensorRT-LLM; NeMo-RL lifts it to the context window too.
        max_seq_len=max_len, max_input_len=max_len, orchestrator_type="ray", ray_worker_extension_cls=EXTENSION,
        kv_cache_config=kv_cache_config, enable_sleep=config.enable_sleep)
    for key in ("max_batch_size", "max_num_tokens", "moe_tensor_parallel_size", "moe_expert_parallel_size"):
        if getattr(config, key) is not None:
            kwargs[key] = getattr(config, key)
    extra = dict(config.llm_kwargs)
    extra.pop("kv_cache_config", None)  # folded into kv_cache_config by the caller
    kwargs.update(extra)
    return kwargs


def token_logprob(entry: Any, token: int) -> float:
    """One ``CompletionOutput.logprobs`` entry: a float, or ``{token_id: Logprob(logprob, rank)}``."""
    if isinstance(entry, dict):
        chosen = entry.get(token)
        if chosen is None:
            raise GrpoSdkError(f"TensorRT-LLM's logprobs for a step do not include the sampled token {token}")
        return float(getattr(chosen, "logprob", chosen))
    return float(entry)


class TrtllmEngineGeneration(TrtllmGeneration, mode="engine"):
    def __init__(self, config: TrtllmConfig | None, context: RunContext):
        super().__init__(config, context)
        import tensorrt_llm
        from tensorrt_llm.llmapi import KvCacheConfig

        try:
            from tensorrt_llm.sampling_params import LogprobMode
        except ImportError:
            raise PluginError(f"tensorrt-llm {getattr(tensorrt_llm, '__version__', '?')} has no LogprobMode, so it "
                              "reports RAW logprobs only (before temperature/top-k/top-p), which differ from the "
                              "policy's; install a version with LogprobMode.PROCESSED (grpo-sdk[trtllm])") from None
        self.trt = tensorrt_llm
        self.processed = LogprobMode.PROCESSED
        kv = {"enable_block_reuse": True, **dict(self.config.llm_kwargs.get("kv_cache_config") or {})}
        if self.config.gpu_memory_utilization is not None:
            kv.setdefault("free_gpu_memory_fraction", self.config.gpu_memory_utilization)
        self.timeout_s = float(context.config.cluster.call_timeout_s)
        self.loop = background_event_loop("grpo-trtllm-engine")
        self.llm = self._run(self._start(engine_kwargs(self.config, context, KvCacheConfig(**kv))))

    async def _start(self, kwargs: dict[str, Any]) -> Any:
        llm = self.trt.AsyncLLM(**kwargs)
        await llm.setup_async()  # on the loop that will drive it (NeMo-RL's post_init_async)
        return llm

    def _run(self, coroutine: Any) -> Any:
        """Run on the engine's loop; every wait has the run's call deadline."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise GrpoSdkError(f"TensorRT-LLM did not answer within {self.timeout_s:g} s "
                               "(cluster.call_timeout_s)") from None

    # --- sampling ----------------------------------------------------------------------------------

    def _complete(self, rows: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        seeds = row_seeds(sampling, len(rows), self.rng)
        params = [self.trt.SamplingParams(logprobs_mode=self.processed, **{
            k: v for k, v in self.sampling_fields(sampling, seed).items() if v is not None}) for seed in seeds]

        async def one(row: list[int], param: Any) -> Completion:
            out = (await self.llm.generate_async(inputs={"prompt_token_ids": row}, sampling_params=param)).outputs[0]
            tokens = list(out.token_ids)
            logprobs = [token_logprob(entry, token) for entry, token in zip(out.logprobs or [], tokens)]
            return tokens, logprobs, out.finish_reason or "stop"

        async def all_rows() -> list[Completion]:
            return list(await asyncio.gather(*(one(r, p) for r, p in zip(rows, params))))

        return self._run(all_rows())

    # --- weights and memory ------------------------------------------------------------------------

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return list(self._run(self.llm.collective_rpc(method, args=args)) or [])

    def _device_uuid(self, index: int) -> str:
        """The UUID of the trainer's GPU ``index``, which must be one of the workers' GPUs (verl keys the
        handles the same way); the workers say which they are on, computed TensorRT-LLM's way."""
        uuid = device_uuid(index)
        workers = self._rpc("grpo_device_uuid")
        if uuid not in workers:
            raise GrpoSdkError(f"CUDA IPC: the weights are on GPU {uuid}, and TensorRT-LLM's workers are on "
                               f"{workers}; handles only work on the same GPU (colocate generation with the policy, "
                               "or use weight_sync.backend=disk or collective)")
        return uuid

    def _update(self, weights: dict[str, str] | None, *, op: str | None = None, version: int | None = None,
                tensors: int | None = None) -> None:
        if op is None:  # upstream's IPC handles / finalise
            self._rpc("update_weights", weights)
            return
        # Our extension's method directly: its reply (version, tensor count) comes back per worker.
        replies = self._rpc("grpo_refit", parse_command(weights))
        check_replies(replies, op=op, version=version, tensors=tensors, where="TensorRT-LLM engine")

    def _release(self, tags: Sequence[str]) -> None:
        self._rpc("reset_prefix_cache")  # release() frees the KV cache but not the prefix index (NeMo-RL)
        self._run(self.llm.release(list(tags)))

    def _resume(self, tags: Sequence[str]) -> None:
        self._run(self.llm.resume(list(tags)))

    def shutdown(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm.shutdown()
            self.llm = None
