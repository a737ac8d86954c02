"""Engine mode: ``sglang.Engine`` in this process (its scheduler and detokenizer in subprocesses of
its own), as verl drives SGLang.

The methods called and their arguments are those of SGLang 0.5.23's
``sglang/srt/entrypoints/engine.py`` (``Engine.generate``, ``update_weights_from_tensor``,
``update_weights_from_disk``, ``init_weights_update_group``, ``update_weights_from_distributed``,
``destroy_weights_update_group``, ``release_memory_occupation``, ``resume_memory_occupation``,
``shutdown``); tests/backends/test_sglang_engine.py pins every call
against that wheel's signatures. Differences from server mode, all SGLang's:

* ``Engine``'s weight-update methods take no ``weight_version`` (the HTTP requests do), so the
  engine keeps reporting its launch version; the adapter tracks the version itself and trusts the
  methods' ``(success, message)`` answer.
* ``pause_generation`` / ``continue_generation`` exist on the server only (``PauseGenerationReqInput``'s
  docstring); in one process ``generate`` blocks, so draining is the adapter's own lock.
"""

from __future__ import annotations

from typing import Any

from grpo_sdk.plugins import PluginError, RunContext

from grpo_sdk.backends.sglang.config import SGLangConfig


def engine_arguments(config: SGLangConfig, context: RunContext) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)``: ``ServerArgs`` fields (sglang/srt/server_args.py, 0.5.23)."""
    cfg = context.config
    kwargs: dict[str, Any] = dict(
        model_path=context.model_path, tokenizer_path=context.tokenizer_path,
        skip_tokenizer_init=True,  # token ids in, token ids out: what the policy scores is what was sampled
        random_seed=context.seed if config.random_seed is None else config.random_seed,
        dtype=config.dtype, context_length=config.context_length or cfg.policy.max_total_sequence_length,
        tp_size=config.tp_size, dp_size=config.dp_size, disable_cuda_graph=config.disable_cuda_graph,
        disable_radix_cache=config.disable_radix_cache, log_level=config.log_level,
        enable_memory_saver=config.needs_offload,
    )
    if config.mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = config.mem_fraction_static
    if config.attention_backend is not None:
        kwargs["attention_backend"] = config.attention_backend
    kwargs.update(config.engine_kwargs)
    return kwargs


class SGLangEngine:
    """The engine operations the backend uses, as calls on an in-process ``sglang.Engine``."""

    def __init__(self, config: SGLangConfig, context: RunContext):
        import sglang

        self.engine = sglang.Engine(**engine_arguments(config, context))
        self.parallel_ranks = config.tp_size
        self.memory_saver = config.needs_offload

    # --- sampling ------------------------------------------------------------------------------------

    def generate(self, request: dict[str, Any]) -> Any:
        return self.engine.generate(input_ids=request["input_ids"], sampling_params=request["sampling_params"],
                                    return_logprob=request["return_logprob"])

    # --- weights -------------------------------------------------------------------------------------

    def update_weights_from_tensor(self, payloads: list[bytes], *, load_format: str | None, flush_cache: bool,
                                   weight_version: str | None) -> None:
        _expect_success("update_weights_from_tensor", self.engine.update_weights_from_tensor(
            named_tensors=payloads, load_format=load_format, flush_cache=flush_cache))

    def update_weights_from_disk(self, model_path: str, *, weight_version: str) -> None:
        _expect_success("update_weights_from_disk", self.engine.update_weights_from_disk(model_path=model_path))

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        _expect_success("init_weights_update_group", self.engine.init_weights_update_group(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend))

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool, weight_version: str | None) -> None:
        _expect_success("update_weights_from_distributed", self.engine.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache))

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.engine.destroy_weights_update_group(group_name=group_name)

    def weight_version(self) -> str | None:
        return None  # the Engine API cannot set it (see the module docstring): nothing to compare

    # --- colocation and refits ----------------------------------------------------------------------

    def release_memory_occupation(self) -> None:
        self.engine.release_memory_occupation(tags=None)

    def resume_memory_occupation(self) -> None:
        self.engine.resume_memory_occupation(tags=None)

    def pause_generation(self, mode: str) -> None:
        pass  # server-only in SGLang; the adapter has drained its own (blocking) calls already

    def continue_generation(self) -> None:
        pass

    def shutdown(self) -> None:
        self.engine.shutdown()


def _expect_success(method: str, result: Any) -> None:
    """The weight methods answer ``(success, message[, ...])`` from the tokenizer manager."""
    if isinstance(result, (tuple, list)) and result and result[0] is False:
        message = result[1] if len(result) > 1 else ""
        raise PluginError(f"sglang.Engine.{method} failed: {message}")
