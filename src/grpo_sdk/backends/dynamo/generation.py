"""Generation through a running NVIDIA Dynamo deployment; weights through its workers' refit routes.

Checked against the real sources (docs/dynamo.md, "Sources"):

* Generation, as NeMo-RL's Dynamo backend sends it (NVIDIA-NeMo/RL 7ea279a,
  nemo_rl/models/generation/dynamo/dynamo_generation.py ``_build_completion_request`` /
  ``_parse_dynamo_completion_response``): one ``POST {frontend}/v1/completions`` per prompt row,
  the prompt as token ids, ``logprobs: 0`` (the sampled token's only), ``nvext.extra_fields:
  ["completion_token_ids"]``; the reply's ``nvext.completion_token_ids``,
  ``choices[0].logprobs.token_logprobs`` and ``choices[0].finish_reason`` ("length" = truncated).
  A worker started with ``--enable-rl`` samples with ``logprobs_mode=processed_logprobs``
  (ai-dynamo 1.3.0.post1, dynamo/vllm/args.py ``configure_rl_logprobs_mode``), so the logprobs are
  those of the distribution each token was sampled from (temperature, top-k, top-p applied), as
  the loop expects. The request's ``seed`` reaches vLLM's SamplingParams through the frontend's
  sampling options (dynamo/vllm/handlers.py ``build_sampling_params``); each row gets ``seed + row``.
* Weights, through each worker's system server (``POST {system_url}/engine/<route>``, registered in
  dynamo/vllm/worker_factory.py ``register_engine_routes``; bodies as dynamo/vllm/handlers.py
  ``BaseWorkerHandler`` reads them, payloads as NeMo-RL's nemo_rl/models/generation/dynamo/refit.py):
  ``init_weights_update_group`` with ``engine_rpc: init_weight_transfer_engine`` and ``init_info``
  (vLLM's NCCLWeightTransferInitInfo: master_address, master_port, rank_offset, world_size), then
  per sync ``update_weights_from_distributed`` with ``engine_rpc`` start_weight_update /
  update_weights (``update_info``: names, dtype_names, shapes, ``packed: false`` = one broadcast
  per tensor in order) / finish_weight_update. Every reply is ``{"status": "ok" | "error", ...}``.

Unlike NeMo-RL (which updates unpaused and flushes the cache in a separate phase), a sync here
takes the handler's own safe path: pause (``mode: wait``, drains), update, reset the prefix cache
on the last step, check ``get_weight_version``, resume.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from grpo_sdk.plugins import GenerationInput, GenerationOutput, GrpoSdkError, PluginError, RunContext, SamplingParams
from grpo_sdk.plugins.toolkit import HTTPClient

from grpo_sdk.backends.dynamo.config import DynamoConfig

KEY = "policy.generation.dynamo"


class DynamoGeneration:
    def __init__(self, config: DynamoConfig | None, context: RunContext):
        self.config = config or DynamoConfig()
        if not self.config.frontend_url or not self.config.worker_urls:
            raise PluginError(f"{KEY}.frontend_url and {KEY}.worker_urls are required (docs/dynamo.md)")
        base = self.config.frontend_url.rstrip("/")
        self.frontend = HTTPClient(base if base.endswith("/v1") else base + "/v1",
                                   timeout_s=self.config.request_timeout_s, what=f"{KEY}.frontend_url")
        self.workers = [HTTPClient(url, timeout_s=self.config.control_timeout_s, what=f"{KEY}.worker_urls[{i}]")
                        for i, url in enumerate(self.config.worker_urls)]
        self.model_name = self.config.model_name or context.config.policy.model_name
        self.pad_token_id = context.pad_token_id if context.pad_token_id is not None else 0
        self.weight_version = 0
        # One thread per worker for the refit routes (every worker must take part in each broadcast
        # together), and a bounded pool for completion requests.
        self._control = ThreadPoolExecutor(max_workers=len(self.workers), thread_name_prefix="dynamo-control")
        self._requests = ThreadPoolExecutor(max_workers=self.config.max_concurrent_requests,
                                            thread_name_prefix="dynamo-request")
        self._gate = threading.Condition()
        self._running = 0  # generate calls in progress
        self._paused_by_caller = False  # pause_generation was called: a sync must not resume
        self._sync_paused = False  # this sync paused the workers itself
        self._sync_version: int | None = None  # the sync in progress (start_weight_update sent)
        self._check_deployment()

    # --- startup ---------------------------------------------------------------------------------

    def _check_deployment(self) -> None:
        """Fail at construction, naming the setting, when the frontend does not serve the model or a
        worker's system server does not answer (NeMo-RL waits for the same two facts)."""
        reply = self.frontend.get("/models", timeout_s=min(30.0, self.config.request_timeout_s))
        served = [m.get("id") for m in (reply or {}).get("data", []) if isinstance(m, dict)]
        if self.model_name not in served:
            raise GrpoSdkError(f"the Dynamo frontend {self.frontend.base_url} does not serve {self.model_name!r} "
                               f"(it serves {served}); set {KEY}.model_name to the workers' --served-model-name")
        for worker in self.workers:
            worker.get("/health", timeout_s=min(30.0, self.config.control_timeout_s))

    # --- generation ------------------------------------------------------------------------------

    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]
        self._enter()
        try:
            version = self.weight_version
            futures = [self._requests.submit(self._complete, row, sampling,
                                             None if sampling.seed is None else sampling.seed + i)
                       for i, row in enumerate(rows)]
            results = [f.result() for f in futures]  # each request has its own HTTP deadline
        finally:
            self._leave()
        width = max((len(tokens) for tokens, _, _ in results), default=0)
        response_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (tokens, row_logprobs, _) in enumerate(results):
            response_ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[i, :len(tokens)] = torch.tensor(row_logprobs, dtype=torch.float32)
        return GenerationOutput(
            response_ids=response_ids, response_lengths=torch.tensor([len(t) for t, _, _ in results], dtype=torch.long),
            logprobs=logprobs, truncated=torch.tensor([t for _, _, t in results], dtype=torch.bool),
            weight_version=version)

    def _complete(self, prompt: list[int], sampling: SamplingParams, seed: int | None) -> tuple[list[int], list[float], bool]:
        body: dict[str, Any] = {
            "model": self.model_name, "prompt": prompt, "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1, "n": 1,
            "logprobs": 0, "include_stop_str_in_output": True, "nvext": {"extra_fields": ["completion_token_ids"]}}
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if seed is not None:
            body["seed"] = seed
        return parse_completion(self.frontend.post("/completions", body), self.frontend.base_url + "/completions")

    # --- the drain gate (PausesForRefit) ---------------------------------------------------------

    def _enter(self) -> None:
        deadline = time.monotonic() + self.config.request_timeout_s
        with self._gate:
            while self._paused_by_caller:
                if not self._gate.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise GrpoSdkError(f"generate waited {self.config.request_timeout_s:g} s for resume_generation "
                                       f"after pause_generation ({KEY}.request_timeout_s)")
            self._running += 1

    def _leave(self) -> None:
        with self._gate:
            self._running -= 1
            self._gate.notify_all()

    def pause_generation(self, *, keep_in_flight: bool) -> None:
        """Drain: new generate calls wait; returns once the running one has finished and every worker
        has paused (``mode: wait``). ``keep_in_flight=True`` is refused, as NeMo-RL refuses in-flight
        updates for Dynamo: its layerwise reload is not safe under running requests."""
        if keep_in_flight:
            raise PluginError("the dynamo backend cannot keep requests in flight across a weight update (Dynamo's "
                              "layerwise reload is not safe under running requests); set "
                              "grpo.async_grpo.in_flight_weight_updates=false")
        deadline = time.monotonic() + self.config.request_timeout_s
        with self._gate:
            self._paused_by_caller = True
            while self._running:
                if not self._gate.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise GrpoSdkError(f"the running generate did not finish within {self.config.request_timeout_s:g} s "
                                       f"of pause_generation ({KEY}.request_timeout_s)")
        self._on_workers("pause_generation", lambda i: {"mode": "wait", "clear_cache": False})

    def resume_generation(self, *, recompute_kv_cache: bool) -> None:
        self._on_workers("resume_generation", lambda i: {})
        with self._gate:
            self._paused_by_caller = False
            self._gate.notify_all()

    # --- weights (ReceivesBroadcast) -------------------------------------------------------------

    @property
    def broadcast_peer(self) -> str:
        """The workers' weight-transfer engine is vLLM's (NCCL): rank 0 must be vLLM's kind of group.
        The stand-in's gloo group is a torch one."""
        return "vllm" if self.config.weight_transfer_backend == "nccl" else "torch"

    def broadcast_ranks(self) -> int:
        return len(self.workers) * self.config.ranks_per_worker

    def join_broadcast(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str) -> None:
        """Every worker joins the group at once (the rendezvous waits for all ranks).

        Against real workers (``nccl``) the payload is exactly NeMo-RL's: vLLM's weight-transfer
        engine builds one unnamed StatelessProcessGroup + PyNcclCommunicator, so ``group_name`` is
        not sent, and ``broadcast_peer`` tells the transport to build rank 0 the same way (vLLM's
        trainer-side construction; needs vllm on the trainer). With ``gloo`` (the stand-in only:
        vLLM's engine is NCCL-only) ``init_info`` also names the torch group, which the stand-in's
        torch construction needs."""
        if backend != self.config.weight_transfer_backend:
            raise PluginError(f"the collective transport uses {backend!r} but the Dynamo workers were started with "
                              f"weight-transfer backend {self.config.weight_transfer_backend!r} "
                              f"({KEY}.weight_transfer_backend); they must match")
        ranks = self.config.ranks_per_worker
        extra = {"group_name": group_name} if backend == "gloo" else {}  # the stand-in's torch group (docstring)
        self._on_workers("init_weights_update_group", lambda i: {
            "engine_rpc": "init_weight_transfer_engine",
            "init_info": {"master_address": master_address, "master_port": master_port,
                          "rank_offset": rank_offset + i * ranks, "world_size": world_size, **extra}})

    def receive_broadcast(self, tensors: Sequence[tuple[str, tuple[int, ...], str]], *, group_name: str,
                          version: int, last: bool) -> None:
        """One ``update_weights`` step on every worker, concurrently (rank 0 broadcasts each tensor
        meanwhile). The first call of a sync pauses the workers (unless the caller already did) and
        starts the update; the last finishes it, resets the prefix cache, checks the version, resumes."""
        tag = str(version)
        common = {"allow_unpaused": False, "weight_version": tag}
        if not self._sync_paused and not self._paused_by_caller:
            self._on_workers("pause_generation", lambda i: {"mode": "wait", "clear_cache": False})
            self._sync_paused = True
        try:
            if self._sync_version != version:
                self._on_workers("update_weights_from_distributed", lambda i: {
                    **common, "reset_prefix_cache": False, "engine_rpc": "start_weight_update",
                    "is_checkpoint_format": True})
                self._sync_version = version
            update_info = {"names": [n for n, _, _ in tensors], "dtype_names": [d for _, _, d in tensors],
                           "shapes": [list(s) for _, s, _ in tensors], "packed": False}
            self._on_workers("update_weights_from_distributed", lambda i: {
                **common, "reset_prefix_cache": False, "engine_rpc": "update_weights", "update_info": update_info})
            if last:
                self._on_workers("update_weights_from_distributed", lambda i: {
                    **common, "reset_prefix_cache": True, "engine_rpc": "finish_weight_update"})
                self._sync_version = None
                self._check_versions(tag)
                self.weight_version = version
        except BaseException:
            self._sync_version = None
            raise  # the workers stay paused: they may hold half an update (Dynamo's own advice)
        if last and self._sync_paused:
            self._on_workers("resume_generation", lambda i: {})
            self._sync_paused = False

    def _check_versions(self, tag: str) -> None:
        if not self.config.check_weight_version:
            return
        replies = self._on_workers("get_weight_version", lambda i: {})
        wrong = {self.config.worker_urls[i]: r.get("version") for i, r in enumerate(replies) if r.get("version") != tag}
        if wrong:
            raise GrpoSdkError(f"Dynamo workers report another weight version than {tag!r} after the update: {wrong}; "
                               "they did not take it")

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        raise PluginError("the dynamo backend receives weights only from the collective transport "
                          "(weight_sync.backend=collective): Dynamo's vLLM workers have no tensor-upload route")

    # --- the worker routes -----------------------------------------------------------------------

    def _on_workers(self, route: str, body: Callable[[int], dict]) -> list[dict]:
        """``POST /engine/<route>`` on every worker at once; every call ends (each has a deadline)
        before the first failure is raised, naming the worker and the route."""
        futures = [self._control.submit(worker.post, f"/engine/{route}", body(i)) for i, worker in enumerate(self.workers)]
        replies, errors = [], []
        for url, future in zip(self.config.worker_urls, futures):
            try:
                reply = future.result()
            except GrpoSdkError as exc:
                errors.append(str(exc))
                continue
            if not isinstance(reply, dict) or reply.get("status") != "ok":
                message = reply.get("message", reply) if isinstance(reply, dict) else reply
                errors.append(f"Dynamo worker {url} route /engine/{route} failed: {message}")
            replies.append(reply if isinstance(reply, dict) else {})
        if errors:
            raise GrpoSdkError("; ".join(errors))
        return replies

    # --- lifecycle -------------------------------------------------------------------------------

    def prepare_for_generation(self) -> None:
        """Nothing: the deployment is not colocated and stays awake."""

    def finish_generation(self) -> None:
        """Nothing: the prefix cache is reset with each weight update, not after each round."""

    def shutdown(self) -> None:
        """The deployment outlives the run; only this client's threads stop."""
        self._requests.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=True)


def parse_completion(reply: Any, url: str) -> tuple[list[int], list[float], bool]:
    """``(token ids, logprobs, truncated)`` of one ``/v1/completions`` reply, or an error naming
    what is missing (NeMo-RL reads the same fields: ``_parse_dynamo_completion_response``)."""
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list) or not reply["choices"]:
        raise GrpoSdkError(f"the Dynamo completion reply from {url} has no choices: {str(reply)[:500]}")
    choice = reply["choices"][0]
    tokens = (reply.get("nvext") or {}).get("completion_token_ids")
    if not isinstance(tokens, list):
        raise GrpoSdkError(f"the Dynamo completion reply from {url} has no nvext.completion_token_ids; the request "
                           "asks for them with nvext.extra_fields, so the frontend is older than that field")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise GrpoSdkError(f"the Dynamo request to {url} ended with finish_reason={finish!r} (not stop or length)")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") if tokens else []
    if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
        raise GrpoSdkError(f"the Dynamo completion reply from {url} has {len(logprobs or [])} token logprobs for "
                           f"{len(tokens)} tokens; the workers must run with --enable-rl")
    return [int(t) for t in tokens], [float(x) for x in logprobs], finish == "length"
