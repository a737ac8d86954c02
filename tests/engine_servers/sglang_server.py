"""STAND-IN for ``python -m sglang.launch_server``'s HTTP API, on a real tiny transformers model.

Routes, request fields and reply shapes follow SGLang 0.5.23 (PyPI wheel
``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``): ``sglang/srt/entrypoints/http_server.py``
for the routes and replies, ``sglang/srt/managers/io_struct.py`` for the request structs,
``sglang/srt/sampling/sampling_params.py`` for ``sampling_params``, ``schedule_batch.py`` for
``finish_reason``, ``tokenizer_manager.py`` for ``meta_info`` (with ``--skip-tokenizer-init``:
``output_ids``, ``output_token_logprobs`` as ``[logprob, token_id, null]``), and
``model_runner_components/weight_updater.py`` for the flattened-bucket payload. Unknown request
fields are refused with 400 (SGLang's msgspec structs reject them too), so an adapter typo fails.

What it is not: SGLang. The tokens come from grpo-sdk's hf sampling loop (base.EngineModel), one
request at a time; no radix cache (``flush_cache`` only answers), no memory saver (release/resume
flip a flag, and generating while released is refused, as a released engine cannot generate),
``pause_generation`` blocks new requests until ``continue_generation`` (its modes are accepted,
nothing is in flight to abort or retract), and with top-p/top-k its logprobs are renormalised
(SGLang's are not; the adapter's config check refuses those settings). CUDA IPC payloads cannot be
tested here: CPU tensors arrive by value.

Test-only route: ``POST /_standin/fault`` ``{"route": "/x", "status": 500}`` makes ``/x`` fail;
``{"ignore_weight_version": true}`` makes updates keep the old version (the adapter must notice).

    python -m engine_servers.sglang_server --model DIR [--port N] [--memory-saver]
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time
import uuid
from typing import Any

from engine_servers.base import EngineModel, HTTPFailure, main

VERSION = "0.5.23"
PAUSE_WAIT_S = 60.0

GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob", "rid", "stream", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs"}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "sampling_seed",
                   "ignore_eos", "skip_special_tokens", "n", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "min_new_tokens", "stop", "no_stop_trim"}
REQUEST_FIELDS = {
    "/update_weights_from_tensor": {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                                    "weight_version", "selector", "torch_empty_cache"},
    "/update_weights_from_disk": {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
                                  "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step",
                                  "flush_cache", "manifest"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format", "selector",
                                         "torch_empty_cache"},
    "/destroy_weights_update_group": {"group_name"},
    "/release_memory_occupation": {"tags"},
    "/resume_memory_occupation": {"tags"},
    "/pause_generation": {"mode"},
    "/continue_generation": {"torch_empty_cache"},
    "/update_weight_version": {"new_version", "abort_all_requests"},
}
# What SGLang's SafeUnpickler (sglang/srt/utils/common.py) lets through that a payload needs.
SAFE_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"), ("torch", "Size"),
                ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"), ("collections", "OrderedDict"),
                ("types", "SimpleNamespace"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict")}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in SAFE_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                               torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


class SGLangStandIn:
    def __init__(self, model: EngineModel, memory_saver: bool):
        self.model = model
        self.memory_saver = memory_saver
        self.version = "default"  # ServerArgs.weight_version's default
        self.faults: dict[str, int] = {}
        self.ignore_weight_version = False
        self.lock = threading.Lock()  # one model, one request at a time
        self.resumed = threading.Event()
        self.resumed.set()
        self.counts: dict[str, int] = {}

    def routes(self) -> dict[tuple[str, str], Any]:
        table = {
            ("POST", "/generate"): self.generate,
            ("POST", "/update_weights_from_tensor"): self.update_from_tensor,
            ("POST", "/update_weights_from_disk"): self.update_from_disk,
            ("POST", "/init_weights_update_group"): self.init_group,
            ("POST", "/update_weights_from_distributed"): self.update_from_distributed,
            ("POST", "/destroy_weights_update_group"): self.destroy_group,
            ("POST", "/update_weight_version"): self.update_weight_version,
            ("POST", "/pause_generation"): self.pause,
            ("POST", "/continue_generation"): self.continue_,
            ("GET", "/model_info"): self.model_info, ("GET", "/get_model_info"): self.model_info,
            ("GET", "/server_info"): self.server_info, ("GET", "/get_server_info"): self.server_info,
            ("GET", "/health"): lambda body, query: None, ("GET", "/health_generate"): lambda body, query: None,
            ("POST", "/_standin/fault"): self.fault, ("GET", "/_standin/counts"): lambda body, query: self.counts,
        }
        for method in ("GET", "POST"):
            table[(method, "/flush_cache")] = self.flush_cache
            table[(method, "/release_memory_occupation")] = self.release
            table[(method, "/resume_memory_occupation")] = self.resume
        return {key: self._guard(key[1], fn) for key, fn in table.items()}

    def _guard(self, path: str, fn: Any) -> Any:
        def route(body: Any, query: Any) -> Any:
            self.counts[path] = self.counts.get(path, 0) + 1
            if path in self.faults:
                raise HTTPFailure(self.faults[path], f"stand-in fault injected on {path}")
            allowed = REQUEST_FIELDS.get(path)
            if allowed is not None and isinstance(body, dict) and set(body) - allowed:
                raise HTTPFailure(400, f"unknown field(s) {sorted(set(body) - allowed)} for {path}")
            return fn(body or {}, query)
        return route

    # --- sampling --------------------------------------------------------------------------------

    def generate(self, body: dict, query: Any) -> Any:
        if set(body) - GENERATE_FIELDS:
            raise HTTPFailure(400, f"unknown GenerateReqInput field(s) {sorted(set(body) - GENERATE_FIELDS)}")
        if body.get("stream"):
            raise HTTPFailure(400, "the stand-in does not stream")
        if not self.resumed.wait(PAUSE_WAIT_S):  # the tokenizer manager holds requests while paused
            raise HTTPFailure(503, "paused too long")
        ids = body.get("input_ids")
        single = bool(ids) and isinstance(ids[0], int)
        rows = [ids] if single else ids
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(rows)
        for p in params:
            if set(p) - SAMPLING_FIELDS:
                raise HTTPFailure(400, f"unknown sampling_params field(s) {sorted(set(p) - SAMPLING_FIELDS)}")
        with self.lock:
            if self.model.released:
                raise HTTPFailure(400, "generate while the memory is released: resume_memory_occupation first")
            out = [self._one(row, p, bool(body.get("return_logprob"))) for row, p in zip(rows, params)]
        return out[0] if single else out

    def _one(self, row: list[int], p: dict, return_logprob: bool) -> dict:
        top_k = p.get("top_k", -1)
        done = self.model.generate([row], max_new_tokens=int(p.get("max_new_tokens", 128)),
                                   temperature=float(p.get("temperature", 1.0)), top_p=float(p.get("top_p", 1.0)),
                                   top_k=None if top_k in (-1, None) or top_k >= 1 << 30 else int(top_k),
                                   stop_token_ids=tuple(p.get("stop_token_ids") or ()), seed=p.get("sampling_seed"))[0]
        finish = ({"type": "length", "length": len(done.tokens)} if done.finish_reason == "length"
                  else {"type": "stop", "matched": done.tokens[-1]})
        meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(row),
                "weight_version": self.version, "num_retractions": 0, "completion_tokens": len(done.tokens),
                "cached_tokens": 0}
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(done.logprobs, done.tokens)]
            meta["output_token_logprobs_length"] = len(done.tokens)
        return {"output_ids": done.tokens, "meta_info": meta}

    # --- weights ---------------------------------------------------------------------------------

    def _set_version(self, version: str | None) -> None:
        if version is not None and not self.ignore_weight_version:
            self.version = version

    def update_from_tensor(self, body: dict, query: Any) -> dict:
        payloads = body["serialized_named_tensors"]
        data = SafeUnpickler(io.BytesIO(base64.b64decode(payloads[0], validate=True))).load()  # TP rank 0's
        if body.get("load_format") == "flattened_bucket":
            flat = data["flattened_tensor"]
            named = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in data["metadata"]]
        elif body.get("load_format") is None:
            named = list(data)
        else:
            raise HTTPFailure(400, f"Unknown load_format={body.get('load_format')}")
        with self.lock:
            self.model.load_tensors(named)
            self._set_version(body.get("weight_version"))
        return {"success": True, "message": "Success"}

    def update_from_disk(self, body: dict, query: Any) -> dict:
        try:
            with self.lock:
                count = self.model.load_directory(body["model_path"])
                self._set_version(body.get("weight_version"))
        except FileNotFoundError as exc:
            raise HTTPFailure(400, f"Failed to update weights: {exc}") from None
        return {"success": True, "message": f"Succeeded to update model weights ({count} tensors).",
                "num_paused_requests": 0}

    def init_group(self, body: dict, query: Any) -> dict:
        self.model.join_group(master_address=body["master_address"], master_port=int(body["master_port"]),
                              rank=int(body["rank_offset"]), world_size=int(body["world_size"]),
                              group_name=body.get("group_name", "weight_update_group"),
                              backend=body.get("backend", "nccl"))
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_from_distributed(self, body: dict, query: Any) -> dict:
        with self.lock:
            self.model.receive(body["names"], body["dtypes"], body["shapes"],
                               body.get("group_name", "weight_update_group"))
            self._set_version(body.get("weight_version"))
        return {"success": True, "message": "Succeeded to update parameter online."}

    def destroy_group(self, body: dict, query: Any) -> dict:
        self.model.leave_group(body.get("group_name", "weight_update_group"))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weight_version(self, body: dict, query: Any) -> dict:
        self._set_version(body["new_version"])
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"]}

    # --- memory, cache, pause --------------------------------------------------------------------

    def flush_cache(self, body: Any, query: Any) -> bytes:
        return b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting " \
               b"requests, the operation will not be performed.)\n"

    def release(self, body: dict, query: Any) -> None:
        if not self.memory_saver:
            raise HTTPFailure(500, "release_memory_occupation needs --enable-memory-saver")
        self.model.released = True
        return None

    def resume(self, body: dict, query: Any) -> None:
        self.model.released = False
        return None

    def pause(self, body: dict, query: Any) -> dict:
        if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
            raise HTTPFailure(400, f"mode must be abort, retract or in_place, not {body.get('mode')!r}")
        self.resumed.clear()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_(self, body: dict, query: Any) -> dict:
        self.resumed.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # --- info ------------------------------------------------------------------------------------

    def model_info(self, body: Any, query: Any) -> dict:
        return {"model_path": self.model_path, "served_model_name": self.model_path, "is_generation": True,
                "weight_version": self.version, "load_format": "auto"}

    def server_info(self, body: Any, query: Any) -> dict:
        return {"model_path": self.model_path, "tp_size": 1, "pp_size": 1, "dp_size": 1,
                "skip_tokenizer_init": True, "enable_memory_saver": self.memory_saver,
                "weight_version": self.version, "version": f"{VERSION} (grpo-sdk stand-in)",
                "startup_time": time.time()}

    def fault(self, body: dict, query: Any) -> dict:
        if "route" in body:
            if body.get("status"):
                self.faults[body["route"]] = int(body["status"])
            else:
                self.faults.pop(body["route"], None)
        if "ignore_weight_version" in body:
            self.ignore_weight_version = bool(body["ignore_weight_version"])
        return {"faults": self.faults, "ignore_weight_version": self.ignore_weight_version}


def build_routes(model: EngineModel, args: Any) -> dict:
    standin = SGLangStandIn(model, memory_saver=args.memory_saver)
    standin.model_path = args.model
    return standin.routes()


def add_arguments(parser: Any) -> None:
    parser.add_argument("--memory-saver", action="store_true", help="as --enable-memory-saver")


if __name__ == "__main__":
    main(build_routes, add_arguments)
