"""Options of the SGLang backend: ``policy.generation.sglang`` (NeMo-RL's ``sglang_cfg`` also works).

Two modes: ``server`` talks to a running ``python -m sglang.launch_server`` over HTTP (how NeMo-RL
and slime drive SGLang); ``engine`` builds ``sglang.Engine`` in this process (how verl does). The
engine arguments below are NeMo-RL's ``sglang_cfg`` keys that still mean something here (NeMo-RL
``nemo_rl/models/generation/sglang/config.py``); NeMo-RL's nested ``sglang_server_config`` keys
``needs_offload`` and ``pause_generation_mode`` are flattened into this block. Checked against
SGLang 0.5.23 (``sglang/srt/server_args.py``, ``sglang/srt/entrypoints/http_server.py``).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MasterConfig, require_engine

INSTALL = "pip install 'grpo-sdk[sglang]'"


@attrs.frozen(kw_only=True)
class SGLangConfig:
    mode: Literal["server", "engine"] = option(
        "server", "server: a running SGLang server at `url` (started with `python -m sglang.launch_server "
        "--skip-tokenizer-init`); engine: sglang.Engine built in this process (needs the sglang wheel and a GPU).")
    url: str | None = option(None, "Server mode: the server's base URL, e.g. http://127.0.0.1:30000.")
    request_timeout_s: float = option(600.0, "Deadline of one /generate call (a whole batch), in seconds.",
                                      validator=attrs.validators.gt(0))
    control_timeout_s: float = option(300.0, "Deadline of one control call (a weight update, release/resume, "
                                      "pause), in seconds.", validator=attrs.validators.gt(0))
    update_bucket_mb: float = option(512.0, "update_weights sends the weights in flattened buckets of at most this "
                                     "many MiB, one /update_weights_from_tensor call each (a larger tensor goes "
                                     "alone).", validator=attrs.validators.gt(0))
    check_weight_version: bool = option(True, "Server mode: after every weight update read the server's "
                                        "weight_version (/model_info) and fail unless it is the synced version.")
    reload_on_start: bool = option(True, "Server mode: a server that already took a weight update (its "
                                   "weight_version is not the launch value 'default': an earlier run's weights) "
                                   "reloads policy.model_name from disk first, so step 1 samples the initial policy; "
                                   "false refuses such a server instead.")
    needs_offload: bool = option(False, "Colocated: release the engine's weights and KV cache after each "
                                 "generation round (/release_memory_occupation) and resume them before the next. "
                                 "The server must run with --enable-memory-saver (engine mode sets it).")
    pause_generation_mode: Literal["abort", "retract", "in_place"] = option(
        "in_place", "Mode of /pause_generation for a draining refit (async GRPO without in-flight updates): the "
        "adapter waits for its own requests first, so nothing is left to abort or retract. An in-flight refit "
        "uses in_place, or retract with grpo.async_grpo.recompute_kv_cache_after_weight_updates=true.")
    # --- engine mode: sglang.Engine(...) arguments (ServerArgs fields) ---
    tp_size: int = option(1, "Tensor parallel GPUs of the engine (server mode: read from the server).",
                          validator=attrs.validators.gt(0))
    dp_size: int = option(1, "Engine mode: data parallel replicas inside the engine.", validator=attrs.validators.gt(0))
    mem_fraction_static: float | None = option(None, "Engine mode: fraction of GPU memory for weights and KV cache; "
                                               "null lets SGLang choose.")
    dtype: str = option("auto", "Engine mode: model dtype (auto, bfloat16, float16, float32).")
    context_length: int | None = option(None, "Engine mode: longest prompt + response; null uses "
                                        "policy.max_total_sequence_length.")
    random_seed: int | None = option(None, "Engine mode: the engine's seed; null uses the run's seed.")
    disable_cuda_graph: bool = option(False, "Engine mode: run eagerly (faster start, slower decode).")
    disable_radix_cache: bool = option(False, "Engine mode: no prefix cache.")
    attention_backend: str | None = option(None, "Engine mode: attention kernels (fa3, triton, flashinfer); null: "
                                           "SGLang's choice.")
    log_level: str = option("error", "Engine mode: SGLang's log level.")
    engine_kwargs: dict[str, Any] = option(factory=dict, help="Engine mode: more sglang.Engine / ServerArgs "
                                           "arguments, passed as they are (NeMo-RL's sglang_kwargs).")


def check_options(config: MasterConfig, options: SGLangConfig, registry: Any) -> list[tuple[str, str]]:
    """Cross-field rules; raises ``PluginError`` (exit 3) when engine mode cannot run here."""
    generation = config.policy.generation
    problems: list[tuple[str, str]] = []
    if options.mode == "server" and not options.url:
        problems.append(("policy.generation.sglang.url",
                         "is required with policy.generation.sglang.mode=server: the base URL of a running SGLang "
                         "server (python -m sglang.launch_server --model-path M --skip-tokenizer-init "
                         "[--enable-memory-saver]), e.g. http://127.0.0.1:30000; or set mode=engine"))
    if options.mode == "engine" and options.url:
        problems.append(("policy.generation.sglang.url",
                         "must be null with policy.generation.sglang.mode=engine: the engine runs in this process; "
                         "set mode=server to use the server at that URL"))
    # sglang/srt/layers/sampler.py (0.5.23) reports log_softmax(logits / T) of the sampled token,
    # before top-k / top-p renormalise the distribution it samples from, so with either filter the
    # logprobs are not those of the sampling distribution, which the policy computes.
    if generation.top_p < 1.0:
        problems.append(("policy.generation.top_p",
                         "must be 1.0 with SGLang: SGLang reports each token's logprob under the temperature-scaled "
                         "distribution before top-p renormalises it (sglang/srt/layers/sampler.py), so it would "
                         "disagree with the policy's logprobs of the distribution actually sampled"))
    if generation.top_k:
        problems.append(("policy.generation.top_k",
                         "must be null with SGLang: SGLang reports logprobs before top-k renormalises the "
                         "distribution (sglang/srt/layers/sampler.py), so they would disagree with the policy's"))
    async_grpo = config.grpo.async_grpo
    if async_grpo.enabled and async_grpo.in_flight_weight_updates and options.mode == "engine":
        problems.append(("policy.generation.sglang.mode",
                         "must be server with grpo.async_grpo.in_flight_weight_updates=true: SGLang pauses requests "
                         "in flight (/pause_generation in_place or retract) on its server only; sglang.Engine has no "
                         "pause_generation"))
    if options.needs_offload and async_grpo.enabled:
        problems.append(("policy.generation.sglang.needs_offload",
                         "must be false with grpo.async_grpo.enabled=true: a released engine holds no weights or KV "
                         "cache, so it cannot generate while the policy trains"))
    if options.needs_offload and not generation.colocated.enabled:
        problems.append(("policy.generation.sglang.needs_offload",
                         "needs policy.generation.colocated.enabled=true: releasing the engine's memory only helps "
                         "a policy training on the same GPUs"))
    if options.mode == "server" and config.cluster.runtime == "ray" and config.cluster.generation_workers > 1:
        problems.append(("cluster.generation_workers",
                         "must be 1 with policy.generation.sglang.mode=server: every generation worker would drive the same "
                         "server, joining its weight-update group and loading each update once per worker; the server "
                         "batches concurrent requests itself (to spread load over several servers, put a router in front "
                         "and point policy.generation.sglang.url at it)"))
    if options.mode == "engine" and not problems:  # a config to fix first (exit 2), then what to install
        require_engine("sglang", INSTALL, gpu=True)  # PluginError: exit 3 before anything starts
    return problems
