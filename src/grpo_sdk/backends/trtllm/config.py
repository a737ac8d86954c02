"""Options of the TensorRT-LLM backend: ``policy.generation.trtllm`` (NeMo-RL's ``trtllm_cfg`` also works).

The engine keys are NeMo-RL's ``trtllm_cfg`` (NeMo-RL ``nemo_rl/models/generation/trtllm/config.py``,
``TrtllmSpecificArgs``, read at NVIDIA-NeMo/RL 7ea279ab): ``tensor_parallel_size``,
``gpu_memory_utilization``, ``max_model_len``, ``precision``, ``max_batch_size``, ``max_num_tokens``,
``async_engine``, ``moe_tensor_parallel_size``, ``moe_expert_parallel_size``, plus NeMo-RL's
``trtllm_kwargs`` escape hatch as ``llm_kwargs``. NeMo-RL's ``in_flight_weight_updates`` /
``recompute_kv_cache_after_weight_updates`` copies are not taken: this backend does not do in-flight
updates (docs/trtllm.md says why), and ``grpo.async_grpo`` holds the run's own setting. Light: no
torch, no engine import.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MasterConfig, require_engine

INSTALL = ("pip install 'grpo-sdk[trtllm]' --extra-index-url https://pypi.nvidia.com "
           "(the tensorrt-llm package on PyPI is a stub that fetches the real wheel from NVIDIA's index)")

MODE_KEY = "policy.generation.trtllm.mode"


@attrs.frozen(kw_only=True)
class TrtllmConfig:
    mode: Literal["engine", "server"] = option(
        "engine", "engine: TensorRT-LLM's LLM API (PyTorch backend) in this process, its workers orchestrated by Ray "
        "(needs tensorrt-llm and an NVIDIA GPU here). server: a running `trtllm-serve` at `url`, driven over HTTP "
        "(/v1/completions with token ids; /update_weights, /release_memory, /resume_memory).")
    url: str | None = option(None, "server mode: the trtllm-serve base URL, e.g. http://10.0.0.5:8000.")
    request_timeout_s: float = option(600.0, "server mode: deadline of one HTTP call (a generate of a whole batch "
                                      "included); a server that does not answer in time fails the run with the URL.",
                                      validator=attrs.validators.gt(0))
    worker_extension: bool = option(
        True, "server mode: the server was started with grpo-sdk's worker extension (`ray_worker_extension_cls: "
        "grpo_sdk.backends.trtllm.worker_extension.GrpoWorkerExtension` and `orchestrator_type: ray` in its "
        "--extra_llm_api_options YAML, docs/trtllm.md). It carries the disk and collective weight paths over "
        "trtllm-serve's own /update_weights route; without it only CUDA IPC handles (colocated, CUDA tensors) work.")
    reload_on_start: bool = option(
        True, "server mode: load policy.model_name's safetensors into the server before the first generation "
        "(grpo-sdk's extension, load_file). trtllm-serve keeps no weight version, so a server that served another "
        "run cannot be told apart from a fresh one and would still hold that run's last weights. The server must "
        "see the trainer's model directory; false skips this (a fresh server, or a shared filesystem missing).")
    accept_raw_logprobs: bool = option(
        False, "server mode: run even when sampling is filtered (temperature != 1, top_p < 1 or top_k). trtllm-serve "
        "returns RAW logprobs (TensorRT-LLM's LogprobMode.RAW default; its /v1/completions has no field for "
        "PROCESSED), which then differ from the policy's: token_mult_prob_error moves away from 1.")
    tensor_parallel_size: int = option(1, "GPUs one engine shards the model over.", validator=attrs.validators.gt(0))
    gpu_memory_utilization: float | None = option(
        None, "KvCacheConfig.free_gpu_memory_fraction: share of the free GPU memory the KV cache takes; null: "
        "TensorRT-LLM's default.", validator=attrs.validators.optional([attrs.validators.gt(0),
                                                                       attrs.validators.le(1)]))
    max_model_len: int | None = option(None, "max_seq_len (and max_input_len) of the engine; null uses "
                                       "policy.max_total_sequence_length.")
    precision: Literal["auto", "float32", "bfloat16", "float16"] | None = option(
        None, "Engine dtype; null uses policy.precision.")
    max_batch_size: int | None = option(None, "Most requests the engine schedules at once; null: its default.")
    max_num_tokens: int | None = option(None, "Most tokens in one engine step; null: its default.")
    async_engine: bool = option(False, "NeMo-RL's key, accepted as it is: engine mode always drives AsyncLLM (as "
                                "NeMo-RL does; its requests are submitted concurrently), and trtllm-serve runs "
                                "AsyncLLM. Weight updates drain the engine either way: per-token weight versions "
                                "cannot be read back from TensorRT-LLM, so in-flight updates are refused.")
    moe_tensor_parallel_size: int | None = option(None, "MoE layers: tensor-parallel split of the experts.")
    moe_expert_parallel_size: int | None = option(None, "MoE layers: expert-parallel split.")
    enable_sleep: bool = option(False, "engine mode, colocated on a GPU: release the engine's weights and KV cache "
                                "(llm.release) after each generation round and take them back (llm.resume) before the "
                                "next; in server mode the same through /release_memory and /resume_memory.")
    llm_kwargs: dict[str, Any] = option(factory=dict, help="engine mode: more LLM/AsyncLLM constructor arguments "
                                        "(NeMo-RL's trtllm_kwargs), spread last; a `kv_cache_config` dict becomes "
                                        "KvCacheConfig(**it).")


def check_options(config: MasterConfig, options: TrtllmConfig, registry: Any) -> list[tuple[str, str]]:
    """Cross-field rules; raises PluginError (exit 3) when engine mode cannot run here at all."""
    problems: list[tuple[str, str]] = []
    generation = config.policy.generation
    async_grpo = config.grpo.async_grpo
    transport = config.weight_sync.backend
    if async_grpo.enabled and async_grpo.in_flight_weight_updates:
        problems.append(("grpo.async_grpo.in_flight_weight_updates",
                         "must be false with policy.generation.backend=trtllm: TensorRT-LLM can swap weights between "
                         "two scheduler steps (control_action(drain=False)), but it cannot say which weights sampled "
                         "each token of a request, and the loop needs that to age and correct in-flight samples. "
                         "Updates drain the engine first; set grpo.async_grpo.in_flight_weight_updates=false"))
    if options.mode == "server":
        if not options.url:
            problems.append(("policy.generation.trtllm.url", "server mode needs the trtllm-serve URL, e.g. "
                             "policy.generation.trtllm.url=http://127.0.0.1:8000 (or mode=engine)"))
        filtered = generation.temperature != 1.0 or generation.top_p < 1.0 or bool(generation.top_k)
        if filtered and not options.accept_raw_logprobs:
            problems.append(("policy.generation.trtllm.accept_raw_logprobs",
                             "trtllm-serve's /v1/completions reports RAW logprobs (before temperature/top-k/top-p), "
                             "and this run samples with temperature/top_p/top_k filtering, so the generation logprobs "
                             "would not be those the policy computes. Use mode=engine (LogprobMode.PROCESSED), "
                             "unfiltered sampling, or set accept_raw_logprobs=true knowing token_mult_prob_error will "
                             "be off"))
        # inprocess on CUDA tensors takes upstream's IPC path; on the CPU it needs the extension
        # (with device=auto that is known only at run time, where update_weights says so).
        if not options.worker_extension and (transport in ("disk", "collective") or
                                             (transport == "inprocess" and config.cluster.device == "cpu")):
            problems.append(("policy.generation.trtllm.worker_extension",
                             f"weight_sync.backend={transport} reaches trtllm-serve through grpo-sdk's worker "
                             "extension on its /update_weights route; start the server with it (docs/trtllm.md) and "
                             "set worker_extension=true, or send CUDA tensors (the policy on the server's GPU: "
                             "weight_sync.backend=inprocess or cuda_ipc), which upstream's IPC path takes"))
    else:
        if options.url:
            problems.append(("policy.generation.trtllm.url", "is for mode=server; in engine mode the engine runs in "
                             "this process (set mode=server to use a running trtllm-serve)"))
        if options.enable_sleep and async_grpo.enabled:
            problems.append(("policy.generation.trtllm.enable_sleep",
                             "must be false with grpo.async_grpo.enabled=true: a released engine cannot generate "
                             "while the policy trains"))
        if not problems:  # the install check last: a config error is worth more than "not installed"
            require_engine("tensorrt_llm", INSTALL, gpu=True)
    if options.mode == "server" and config.cluster.runtime == "ray" and config.cluster.generation_workers > 1:
        problems.append(("cluster.generation_workers",
                         "must be 1 with policy.generation.trtllm.mode=server: every generation worker would drive the same "
                         "server, joining its weight-update group and loading each update once per worker; the server "
                         "batches concurrent requests itself (to spread load over several servers, put a router in front "
                         "and point policy.generation.trtllm.url at it)"))
    if options.enable_sleep and not generation.colocated.enabled:
        problems.append(("policy.generation.trtllm.enable_sleep",
                         "releases the engine's GPU memory for a colocated policy; without "
                         "policy.generation.colocated.enabled=true there is nothing to make room for"))
    return problems
