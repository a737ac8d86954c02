"""Weight refit for TensorRT-LLM: the messages both sides exchange, and what one engine worker does with them.

TensorRT-LLM's RL hook is its worker extension (``tensorrt_llm/llmapi/rlhf_utils.py::WorkerExtension``,
read at NVIDIA/TensorRT-LLM 04762f3b): ``update_weights(ipc_handles)`` rebuilds CUDA tensors from
``{device_uuid: base64(pickle([(name, (rebuild_fn, args)), ...]))}``, loads them with
``model_loader.reload(model, weights, allow_partial_loading=True)``, and ``update_weights(None)``
finalises (``process_weights_after_loading``, ``post_load_weights``, ``reset_prefix_cache``). It is
reached in process with ``llm.collective_rpc("update_weights", args=(handles,))`` and over HTTP through
trtllm-serve's ``POST /update_weights {"weights": {...} | null}`` (``tensorrt_llm/serve/openai_server.py``:
``collective_rpc('update_weights', args=(request.weights,))``; ``UpdateWeightsRequest.weights`` is
``Optional[Dict[str, str]]`` in ``serve/openai_protocol.py``).

grpo-sdk's extension (worker_extension.py) keeps that route and adds commands under the key
``"grpo_sdk"`` (never a device UUID): ``load_file`` (a safetensors file: the disk transport),
``join`` and ``receive`` (the collective transport's group, modelled on NeMo-RL's ``NcclExtension``
in ``nemo_rl/models/generation/trtllm/trtllm_backend.py``, NVIDIA-NeMo/RL 7ea279ab: join at
``rank_offset + worker rank``, one broadcast per tensor, reload, finalise). Riding on the upstream
route keeps trtllm-serve unmodified: the same JSON works through ``/update_weights`` and through
``collective_rpc``. ``RefitReceiver`` is the worker side, free of TensorRT-LLM so it can run (and be
tested) against any ``load``/``finalize`` pair.
"""

from __future__ import annotations

import base64
import json
from pickle import dumps  # write-only: TensorRT-LLM's IPC payload, never read here
from typing import Any, Callable, Iterable, Sequence

from grpo_sdk.plugins.toolkit import join_process_group, leave_process_group

COMMAND_KEY = "grpo_sdk"
WEIGHT_TAGS = ("sampler", "drafter", "guided_decoder", "spec_resource_manager", "model_extra", "executor_extra",
               "model", "draft_model")
"""ExecutorMemoryType values that hold weights (as verl's TRTLLMAsyncRollout._WEIGHTS_TAGS lists them);
with ``kv_cache`` they are everything ``llm.release`` / ``/release_memory`` can free."""
ALL_TAGS = WEIGHT_TAGS + ("kv_cache",)


def command(op: str, **fields: Any) -> dict[str, str]:
    """The ``weights`` dict of an ``update_weights`` call that carries one grpo-sdk command."""
    return {COMMAND_KEY: json.dumps({"op": op, **fields})}


def parse_command(weights: Any) -> dict[str, Any] | None:
    """The grpo-sdk command in an ``update_weights`` argument, or None (upstream IPC handles / finalise)."""
    if not isinstance(weights, dict) or COMMAND_KEY not in weights:
        return None
    if len(weights) != 1:
        raise ValueError(f"a {COMMAND_KEY!r} command travels alone, got keys {sorted(weights)}")
    body = json.loads(weights[COMMAND_KEY])
    if not isinstance(body, dict) or "op" not in body:
        raise ValueError(f"malformed {COMMAND_KEY!r} command: {weights[COMMAND_KEY][:200]}")
    return body


def ipc_handles(weights: Iterable[tuple[str, Any]], device_uuid: str) -> dict[str, str]:
    """Upstream's payload for CUDA tensors of one GPU: ``{uuid: base64(pickle([(name, reduce_tensor(t))]))}``,
    as verl's ``TRTLLMAsyncRollout.update_weights`` builds it. The tensors must stay alive until the
    engine has loaded them (the caller holds them across the call)."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = []
    for name, tensor in weights:
        if not tensor.is_cuda:
            raise ValueError(f"{name} is on {tensor.device}: CUDA IPC handles need CUDA tensors")
        handles.append((name, reduce_tensor(tensor.detach())))
    return {device_uuid: base64.b64encode(dumps(handles)).decode("ascii")}


def device_uuid(index: int) -> str:
    """The NVML UUID of CUDA device ``index`` (``GPU-...``), which TensorRT-LLM's workers key the handles by."""
    import torch

    return "GPU-" + str(torch.cuda.get_device_properties(index).uuid)


class RefitReceiver:
    """One engine worker's side of a grpo-sdk command.

    ``load(weights: dict[str, Tensor])`` loads a partial state dict into the engine's model (in
    TensorRT-LLM: ``model_loader.reload(..., allow_partial_loading=True)``); ``finalize(version)`` runs
    the post-load processing and drops cached KV. ``rank`` is the worker's rank in its engine (its rank
    in the broadcast group is ``rank_offset + rank``). Every command returns ``{"op", "version",
    "tensors"}`` so the caller can check that each worker took the update.
    """

    def __init__(self, load: Callable[[dict[str, Any]], None], finalize: Callable[[int], None], *, device: Any,
                 rank: int = 0):
        self.load, self.finalize, self.device, self.rank = load, finalize, device, rank
        self.groups: dict[str, Any] = {}
        self.version: int | None = None
        self.received = 0  # tensors loaded since the last finalize

    def run(self, body: dict[str, Any]) -> dict[str, Any]:
        op = body["op"]
        handler = {"load_file": self._load_file, "join": self._join, "receive": self._receive,
                   "leave": self._leave}.get(op)
        if handler is None:
            raise ValueError(f"unknown {COMMAND_KEY!r} command {op!r}")
        tensors = handler(body)
        return {"op": op, "version": self.version, "tensors": tensors}

    def _finish(self, body: dict[str, Any], count: int) -> int:
        self.received += count
        if body.get("last", True):
            self.finalize(int(body["version"]))
            self.version = int(body["version"])
            count, self.received = self.received, 0
        return count

    def _load_file(self, body: dict[str, Any]) -> int:
        from safetensors.torch import load_file

        weights = load_file(body["path"], device=str(self.device))
        self.load(weights)
        return self._finish(body, len(weights))

    def _join(self, body: dict[str, Any]) -> int:
        self.groups[body["group_name"]] = join_process_group(
            backend=body["backend"], master_address=body["master_address"], master_port=int(body["master_port"]),
            world_size=int(body["world_size"]), rank=int(body["rank_offset"]) + self.rank,
            group_name=body["group_name"], timeout_s=float(body.get("timeout_s", 600.0)))
        return 0

    def _receive(self, body: dict[str, Any]) -> int:
        import torch
        import torch.distributed as dist

        group = self.groups.get(body["group_name"])
        if group is None:
            raise KeyError(f"no weight-update group {body['group_name']!r} on this worker; join it first")
        weights = {}
        for name, shape, dtype in body["tensors"]:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=self.device)
            dist.broadcast(tensor, src=0, group=group)  # rank 0 is policy rank 0, one tensor per call
            weights[name] = tensor
        self.load(weights)
        return self._finish(body, len(weights))

    def _leave(self, body: dict[str, Any]) -> int:
        group = self.groups.pop(body["group_name"], None)
        if group is not None:
            leave_process_group(group)
        return 0


def check_replies(replies: Sequence[Any], *, op: str, version: int | None, tensors: int | None, where: str) -> None:
    """Every worker's reply to a command says it took it: the version it now serves and the tensor
    count; raises with what each worker said otherwise."""
    from grpo_sdk.plugins import GrpoSdkError

    if not replies:
        raise GrpoSdkError(f"{where}: no engine worker answered the {op!r} weight command")
    for i, reply in enumerate(replies):
        ok = isinstance(reply, dict) and reply.get("op") == op
        ok = ok and (version is None or reply.get("version") == version)
        ok = ok and (tensors is None or reply.get("tensors") == tensors)
        if not ok:
            raise GrpoSdkError(f"{where}: engine worker {i} did not take the weight update ({op}): it answered "
                               f"{reply!r}, expected version {version} with {tensors} tensors. Its weights are not "
                               "the policy's; the run stops rather than sample with them")
