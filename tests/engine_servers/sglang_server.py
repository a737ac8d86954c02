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

Test-only routes: ``POST /_standin/fault`` ``{"route": "/x", "status": 500}`` makes ``/x`` fail;
``{"ignore_weight_version": true}`` makes updates keep the old version (the adapter must notice);
``{"step_delay_s": 0.05}`` sleeps between decode steps; ``{"reset": true}`` undoes them all.
``GET /_standin/counts``: requests per route.

    python -m engine_servers.sglang_server --model DIR [--port N] [--memory-saver]
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import threading
import time
import uuid
from pathlib import Path
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
        self.names: dict[int, str] = {0: "default"}  # the model's int versions -> SGLang's strings
        self.pause_mode = "in_place"
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
        if not self.resumed.wait(PAUSE_WAIT_S):  # the tokenizer manager holds new requests while paused
            raise HTTPFailure(503, "paused too long")
        ids = body.get("input_ids")
        single = bool(ids) and isinstance(ids[0], int)
        rows = [ids] if single else ids
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(rows)
        for p in params:
            if set(p) - SAMPLING_FIELDS:
                raise HTTPFailure(400, f"unknown sampling_params field(s) {sorted(set(p) - SAMPLING_FIELDS)}")
        with self.lock:  # one generation at a time (an update waits for it unless the server is paused)
            if self.model.released:
                raise HTTPFailure(400, "generate while the memory is released: resume_memory_occupation first")
            # Rows with the same unseeded parameters decode as one batch (an in-flight update lands in
            # all of them); a seeded row decodes alone, from its own seed.
            out: list[Any] = [None] * len(rows)
            groups: dict[str, list[int]] = {}
            for i, p in enumerate(params):
                key = repr(sorted(p.items())) if p.get("sampling_seed") is None else f"row {i}"
                groups.setdefault(key, []).append(i)
            for members in groups.values():
                done = self._batch([rows[i] for i in members], params[members[0]], bool(body.get("return_logprob")))
                for i, reply in zip(members, done):
                    out[i] = reply
        return out[0] if single else out

    def _batch(self, rows: list[list[int]], p: dict, return_logprob: bool) -> list[dict]:
        import torch

        from grpo_sdk.plugins import GenerationInput, SamplingParams

        hf = self.model.hf
        top_k = p.get("top_k", -1)
        width = max(len(r) for r in rows)
        inputs = GenerationInput(
            input_ids=torch.tensor([[hf.pad_token_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long),
            attention_mask=torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long))
        result = hf.generate(inputs, SamplingParams(
            max_new_tokens=int(p.get("max_new_tokens", 128)), temperature=float(p.get("temperature", 1.0)),
            top_p=float(p.get("top_p", 1.0)), top_k=None if top_k in (-1, None) or top_k >= 1 << 30 else int(top_k),
            stop_token_ids=tuple(p.get("stop_token_ids") or ()), seed=p.get("sampling_seed")))
        replies = []
        for i, n in enumerate(result.response_lengths.tolist()):
            tokens = result.response_ids[i, :n].tolist()
            versions = ([result.weight_version] * n if result.token_weight_versions is None
                        else result.token_weight_versions[i, :n].tolist())
            finish = ({"type": "length", "length": n} if bool(result.truncated[i])
                      else {"type": "stop", "matched": tokens[-1]})
            meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(rows[i]),
                    "num_retractions": 0, "completion_tokens": n, "cached_tokens": 0}
            # sglang/srt/utils/weight_versions.py: spans of output tokens per version, and the
            # request's weight_version is the last span's.
            spans: list[dict] = []
            for t, v in enumerate(versions or [result.weight_version]):
                name = self.names.get(v, str(v))
                if spans and spans[-1]["version"] == name:
                    spans[-1]["end"] = t + 1
                else:
                    spans.append({"version": name, "start": t, "end": t + 1})
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in
                                                 zip(result.logprobs[i, :n].tolist(), tokens)]
                meta["output_token_logprobs_length"] = n
            replies.append({"output_ids": tokens, "meta_info": meta})
        return replies

    # --- weights ---------------------------------------------------------------------------------

    def _load(self, named: list, version: str | None) -> None:
        """Load under the version SGLang was told (weight_version: a string; the model's versions are
        ints, mapped both ways). SGLang's tokenizer manager waits for running requests unless paused."""
        if self.ignore_weight_version or version is None:
            number = self.model.weight_version
        else:
            number = int(version) if version.isdigit() else max(self.names) + 1
            self.names[number] = version
        with (contextlib.nullcontext() if not self.resumed.is_set() else self.lock):
            self.model.load_tensors(named, version=number)
        self.version = self.names.get(number, str(number))

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
        self._load(named, body.get("weight_version"))
        return {"success": True, "message": "Success"}

    def update_from_disk(self, body: dict, query: Any) -> dict:
        from safetensors.torch import load_file

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            raise HTTPFailure(400, f"Failed to update weights: no *.safetensors file in {body['model_path']}")
        named = [item for f in files for item in load_file(str(f)).items()]
        self._load(named, body.get("weight_version"))
        return {"success": True, "message": f"Succeeded to update model weights ({len(named)} tensors).",
                "num_paused_requests": 0}

    def init_group(self, body: dict, query: Any) -> dict:
        self.model.join_group(master_address=body["master_address"], master_port=int(body["master_port"]),
                              rank=int(body["rank_offset"]), world_size=int(body["world_size"]),
                              group_name=body.get("group_name", "weight_update_group"),
                              backend=body.get("backend", "nccl"))
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_from_distributed(self, body: dict, query: Any) -> dict:
        import torch
        import torch.distributed as dist

        group = self.model.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:  # weight_updater.py asserts the same
            raise HTTPFailure(400, f"Group {body.get('group_name')} not in {list(self.model.groups)}. Please call "
                                   "`init_weights_update_group` first.")
        received = []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):  # one broadcast per tensor
            tensor = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
            dist.broadcast(tensor, src=0, group=group)
            received.append((name, tensor))
        self._load(received, body.get("weight_version"))
        return {"success": True, "message": "Succeeded to update parameter online."}

    def destroy_group(self, body: dict, query: Any) -> dict:
        self.model.leave_group(body.get("group_name", "weight_update_group"))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weight_version(self, body: dict, query: Any) -> dict:
        if not self.ignore_weight_version:
            self.version = body["new_version"]
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
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPFailure(400, f"mode must be abort, retract or in_place, not {mode!r}")
        if mode == "abort":
            raise HTTPFailure(400, "the stand-in does not implement mode=abort (the adapter never aborts)")
        self.pause_mode = mode
        self.counts[f"pause mode {mode}"] = self.counts.get(f"pause mode {mode}", 0) + 1
        self.model.hf.pause_generation(keep_in_flight=True)  # running requests stay; an update lands between steps
        self.resumed.clear()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_(self, body: dict, query: Any) -> dict:
        # retract: the running requests go back to the queue and re-prefill under the weights now
        # loaded (their KV cache recomputed); in_place: they continue on the cache they have.
        if not self.resumed.is_set():
            self.model.hf.resume_generation(recompute_kv_cache=self.pause_mode == "retract")
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
        if body.get("reset"):
            self.faults.clear()
            self.ignore_weight_version = False
            body = {"step_delay_s": 0}
        if "step_delay_s" in body:  # slow decoding down, so a test can land an update between two steps
            delay = float(body["step_delay_s"])
            self.model.hf._between_decode_steps = (lambda t: time.sleep(delay)) if delay else (lambda t: None)
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
