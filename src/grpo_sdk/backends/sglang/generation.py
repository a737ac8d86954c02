"""SGLang generation: one adapter for both modes (docs/sglang.md).

``mode: server`` speaks HTTP to a running SGLang server (server.py), ``mode: engine`` calls an
in-process ``sglang.Engine`` (engine.py); the requests and replies are the same dicts
(protocol.py). Weights reach the engine by every path SGLang has, one per transport:

* ``inprocess`` -> ``update_weights``: flattened buckets through ``update_weights_from_tensor``
  (CUDA tensors as IPC handles when colocated on a GPU; CPU tensors by value);
* ``disk`` -> ``load_weights`` (``WeightFileLoader``): ``update_weights_from_disk`` of a
  per-version directory holding the file;
* ``collective`` -> ``join_broadcast`` / ``receive_broadcast`` (``ReceivesBroadcast``):
  ``init_weights_update_group`` once, then ``update_weights_from_distributed`` per batch of tensors,
  the last one flushing the cache.

Each update names its version (``weight_version``) and, in server mode, the adapter then reads the
server's ``weight_version`` and fails unless the server took it. Colocated with ``needs_offload``,
``finish_generation`` releases the engine's memory and ``prepare_for_generation`` resumes it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Sequence

import torch

from grpo_sdk.backends.sglang import protocol
from grpo_sdk.backends.sglang.config import SGLangConfig
from grpo_sdk.plugins import GenerationInput, GenerationOutput, PluginError, RunContext, SamplingParams
from grpo_sdk.plugins.toolkit import load_tokenizer

NO_IN_FLIGHT = ("sglang.Engine has no pause_generation (SGLang pauses in flight on its server only): use "
                "policy.generation.sglang.mode=server, or grpo.async_grpo.in_flight_weight_updates=false")


class SGLangGeneration:
    def __init__(self, config: SGLangConfig | None, context: RunContext):
        config = config or SGLangConfig()
        self.config = config
        if config.mode == "server":
            from grpo_sdk.backends.sglang.server import SGLangServer

            if not config.url:
                raise PluginError("policy.generation.sglang.url is required in server mode")
            self.engine: Any = SGLangServer(config.url, request_timeout_s=config.request_timeout_s,
                                            control_timeout_s=config.control_timeout_s)
            self.where = f"the SGLang server at {config.url}"
        else:
            from grpo_sdk.backends.sglang.engine import SGLangEngine

            self.engine = SGLangEngine(config, context)
            self.where = "sglang.Engine"
        self.offload = config.needs_offload and context.config.policy.generation.colocated.enabled
        if self.offload and not self.engine.memory_saver:
            raise PluginError(f"policy.generation.sglang.needs_offload=true, but {self.where} runs without the "
                              "memory saver: restart it with --enable-memory-saver (or set needs_offload=false)")
        if config.mode == "server":
            self._start_from(context.model_path)
        tokenizer = load_tokenizer(context.tokenizer_path)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.weight_version = 0
        self.released = False
        self.groups: set[str] = set()
        # Draining pause (PausesForRefit with keep_in_flight=False): generate calls in flight are
        # counted; a paused adapter lets none start until resumed.
        self._state = threading.Condition()
        self._running = 0
        self._paused = False
        self._kept_in_flight = False
        self.recompute_kv_cache = context.config.grpo.async_grpo.recompute_kv_cache_after_weight_updates

    # --- sampling --------------------------------------------------------------------------------

    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        request = protocol.generate_request(prompts, sampling, self.eos_token_id)
        self._enter()
        try:
            replies = self.engine.generate(request)
        finally:
            self._leave()
        # Server mode reports which weights sampled each token; sglang.Engine cannot be told versions.
        return protocol.parse_outputs(replies, len(request["input_ids"]), self.pad_token_id,
                                      None if self.config.mode == "server" else self.weight_version, self.where)

    # --- weights ---------------------------------------------------------------------------------

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self.prepare_for_generation()  # a released engine holds no weights to update
        buckets = list(protocol.weight_buckets(weights, self.config.update_bucket_mb))
        if not buckets:
            raise PluginError("update_weights got no tensors")
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            payloads = protocol.serialize_payload(protocol.flattened_bucket(bucket), self.engine.parallel_ranks)
            self.engine.update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=last,
                                                   weight_version=str(version) if last else None)
        self._took(version)

    def load_weights(self, path: str, *, version: int) -> None:
        """``WeightFileLoader``: the server reads the file where it runs, so it must see this filesystem."""
        self.prepare_for_generation()
        directory = protocol.version_directory(path, version)
        try:
            self.engine.update_weights_from_disk(str(directory), weight_version=str(version))
        finally:
            for file in directory.iterdir():
                file.unlink()
            directory.rmdir()
        self._took(version)

    def _start_from(self, model_path: str) -> None:
        """A server outlives runs: one that took updates samples an earlier run's weights, which the
        first step would train on as if they were the policy's."""
        reported = self.engine.weight_version()
        if reported in (None, "default", "0"):
            return
        if not self.config.reload_on_start:
            raise PluginError(f"{self.where} holds weights of version {reported!r} from an earlier run; restart it, "
                              "or set policy.generation.sglang.reload_on_start=true to reload policy.model_name")
        self.engine.update_weights_from_disk(model_path, weight_version="0")
        self._took(0)

    # --- ReceivesBroadcast (the collective transport) ----------------------------------------------

    def broadcast_ranks(self) -> int:
        return self.engine.parallel_ranks

    def join_broadcast(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str) -> None:
        self.prepare_for_generation()
        self.engine.init_weights_update_group(master_address=master_address, master_port=master_port,
                                              rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                              backend=backend)
        self.groups.add(group_name)

    def receive_broadcast(self, tensors: Sequence[tuple[str, tuple[int, ...], str]], *, group_name: str,
                          version: int, last: bool) -> None:
        if group_name not in self.groups:
            raise PluginError(f"receive_broadcast for group {group_name!r}, which {self.where} has not joined "
                              "(join_broadcast first)")
        self.engine.update_weights_from_distributed(
            names=[name for name, _, _ in tensors], dtypes=[str(dtype).removeprefix("torch.") for _, _, dtype in tensors],
            shapes=[list(shape) for _, shape, _ in tensors], group_name=group_name, flush_cache=last,
            weight_version=str(version) if last else None)
        if last:
            self._took(version)

    def _took(self, version: int) -> None:
        """The engine must now report ``version``: an engine that answered success but kept its old
        weights is an error, not a silently stale rollout."""
        if self.config.check_weight_version:
            reported = self.engine.weight_version()
            if reported is not None and str(reported) != str(version):
                raise PluginError(f"{self.where} reports weight_version {reported!r} after the update to version "
                                  f"{version}: it did not take the update")
        self.weight_version = version

    # --- colocation ------------------------------------------------------------------------------

    def prepare_for_generation(self) -> None:
        if self.released:
            self.engine.resume_memory_occupation()
            self.released = False

    def finish_generation(self) -> None:
        if self.offload and not self.released:
            self.engine.release_memory_occupation()
            self.released = True

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is None:
            return
        for group in sorted(self.groups):
            try:
                engine.destroy_weights_update_group(group)
            except Exception:  # noqa: BLE001 - shutting down: the server may be gone already
                pass
        engine.shutdown()

    # --- PausesForRefit --------------------------------------------------------------------------
    # keep_in_flight=True is SGLang's own pause (server only): in_place keeps the running requests
    # and their KV cache, retract sends them back to the queue to re-prefill under the new weights
    # after /continue_generation. SGLang picks at pause time; async GRPO's choice is a config key
    # (grpo.async_grpo.recompute_kv_cache_after_weight_updates), read here at construction.

    def pause_generation(self, *, keep_in_flight: bool) -> None:
        if keep_in_flight:
            if self.config.mode != "server":
                raise PluginError(NO_IN_FLIGHT)
            with self._state:
                self._paused = True
            self.engine.pause_generation("retract" if self.recompute_kv_cache else "in_place")
            self._kept_in_flight = True
            return
        deadline = time.monotonic() + self.config.control_timeout_s
        with self._state:
            self._paused = True
            while self._running:
                if not self._state.wait(timeout=max(0.0, deadline - time.monotonic())):
                    self._paused = False
                    self._state.notify_all()
                    raise PluginError(f"pause_generation: {self._running} generate call(s) on {self.where} still "
                                      f"running after {self.config.control_timeout_s:g} s "
                                      "(policy.generation.sglang.control_timeout_s)")
        self.engine.pause_generation(self.config.pause_generation_mode)

    def resume_generation(self, *, recompute_kv_cache: bool) -> None:
        if self._kept_in_flight and recompute_kv_cache != self.recompute_kv_cache:
            raise PluginError(f"resume_generation(recompute_kv_cache={recompute_kv_cache}) after SGLang was paused "
                              f"with mode={'retract' if self.recompute_kv_cache else 'in_place'}: SGLang decides at "
                              "pause time (grpo.async_grpo.recompute_kv_cache_after_weight_updates)")
        self.engine.continue_generation()
        self._kept_in_flight = False
        with self._state:
            self._paused = False
            self._state.notify_all()

    def _enter(self) -> None:
        deadline = time.monotonic() + self.config.request_timeout_s
        with self._state:
            while self._paused:
                if not self._state.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise PluginError(f"generate waited {self.config.request_timeout_s:g} s for a paused "
                                      f"{self.where} to resume")
            self._running += 1

    def _leave(self) -> None:
        with self._state:
            self._running -= 1
            self._state.notify_all()
