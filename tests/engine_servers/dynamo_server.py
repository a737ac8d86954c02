"""Stand-in for a Dynamo deployment: the frontend's OpenAI completions API and ONE vLLM worker's
system routes, on one port, over a real tiny model (``base.EngineModel``).

NOT Dynamo. What it speaks, and where each shape was checked:

* ``GET /v1/models`` and ``POST /v1/completions`` as NeMo-RL's Dynamo backend uses them
  (NVIDIA-NeMo/RL 7ea279a, nemo_rl/models/generation/dynamo/dynamo_generation.py): token-id
  ``prompt``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1 = off), ``seed``,
  ``stop_token_ids``, ``logprobs`` (0: the sampled token's), ``nvext.extra_fields:
  ["completion_token_ids"]``; reply ``choices[0].{finish_reason, logprobs.token_logprobs}`` and
  ``nvext.completion_token_ids``. Logprobs are processed (what ``--enable-rl`` selects: ai-dynamo
  1.3.0.post1 dynamo/vllm/args.py). The EOS or stop token ends the response and is included, as
  vLLM's output token ids include it. ``choices[0].text`` is left empty (no detokenisation).
* ``POST /engine/<route>`` for the RL routes of ai-dynamo 1.3.0.post1
  (dynamo/vllm/worker_factory.py ``register_engine_routes``) with the checks of
  dynamo/vllm/handlers.py ``BaseWorkerHandler``: ``pause_generation`` (mode keep|wait|abort),
  ``resume_generation``, ``flush_cache``, ``get_weight_version`` ("initial" until an update),
  ``init_weights_update_group`` / ``destroy_weights_update_group`` (``engine_rpc`` +
  ``init_info``), ``update_weights_from_distributed`` (``allow_unpaused``, ``reset_prefix_cache``,
  ``weight_version`` reserved; paused unless allowed; both allowed-unpaused and reset is refused;
  ``engine_rpc`` start_weight_update / update_weights / finish_weight_update with vLLM's
  NCCLWeightTransferUpdateInfo fields). Handler failures answer HTTP 200 with ``{"status":
  "error", "message"}`` as the handler does.

What it does not model: etcd/NATS discovery, routing between workers (its frontend routes only to
its own model: two stand-ins are two one-worker deployments), KV cache or prefix cache (a reset
is a no-op), the packed transfer (``packed: true`` is refused), tensor parallel ranks (one rank
per worker), and the group's wire construction: real workers build vLLM's StatelessProcessGroup +
PyNcclCommunicator (NCCL, GPU only), this one grpo_sdk's ``join_process_group`` (gloo on CPU),
whose name the adapter sends as ``init_info.group_name`` in gloo mode only.

Stand-in only: ``--model-name`` (the served name), ``--weight-transfer-backend`` (the worker's
``--weight-transfer-config`` backend), ``--ignore-weight-version`` (records no version: a worker
that did not take the update), and ``POST /standin/fail {"path", "status", "message"}`` (later
calls to ``path`` fail with that HTTP status).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from engine_servers.base import EngineModel, HTTPFailure, main

GROUP = "dynamo-weight-transfer"  # vLLM's engine holds one unnamed group; the stand-in's torch group needs a name


def build_routes(model: EngineModel, args: Any) -> dict:
    served = args.model_name or args.model
    state = {"group": GROUP, "paused": False, "running": 0, "version": "initial", "updating": False, "failures": {}}
    cond = threading.Condition()
    model_lock = threading.Lock()  # one generation at a time: the hf sampler's RNG is not shared across threads

    def fail_if_asked(path: str) -> None:
        failure = state["failures"].get(path)
        if failure:
            raise HTTPFailure(failure["status"], failure.get("message", "injected failure"))

    def models(body: Any, query: dict) -> dict:
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "nvidia"}]}

    def completions(body: Any, query: dict) -> dict:
        fail_if_asked("/v1/completions")
        body = body or {}
        if body.get("model") != served:
            raise HTTPFailure(404, f"Model not found: {body.get('model')!r}")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise HTTPFailure(400, "prompt must be a non-empty list of token ids here")
        with cond:  # a paused engine holds new requests (vLLM's scheduler pause), bounded here
            if not cond.wait_for(lambda: not state["paused"], timeout=300):
                raise HTTPFailure(503, "engine paused for 300 s")
            state["running"] += 1
        try:
            top_k = body.get("top_k")
            with model_lock:
                done = model.generate([prompt], max_new_tokens=int(body.get("max_tokens") or 16),
                                      temperature=float(body.get("temperature", 1.0)),
                                      top_p=float(body.get("top_p", 1.0)),
                                      top_k=None if top_k in (None, -1, 0) else int(top_k),
                                      stop_token_ids=tuple(body.get("stop_token_ids") or ()),
                                      seed=body.get("seed"))[0]
        finally:
            with cond:
                state["running"] -= 1
                cond.notify_all()
        logprobs = None if body.get("logprobs") is None else {
            "tokens": [f"token_id:{t}" for t in done.tokens], "token_logprobs": done.logprobs,
            "top_logprobs": [None] * len(done.tokens), "text_offset": [0] * len(done.tokens)}
        reply = {"id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
                 "model": served, "choices": [{"index": 0, "text": "", "finish_reason": done.finish_reason,
                                               "logprobs": logprobs}],
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(done.tokens),
                           "total_tokens": len(prompt) + len(done.tokens)}}
        if "completion_token_ids" in ((body.get("nvext") or {}).get("extra_fields") or []):
            reply["nvext"] = {"completion_token_ids": done.tokens}
        return reply

    def health(body: Any, query: dict) -> dict:
        return {"status": "ready", "endpoints": ["generate", "rl"]}

    def pause_generation(body: Any) -> dict:
        mode = body.get("mode", "keep")
        if mode not in ("keep", "wait", "abort"):
            return {"status": "error", "message": f"Invalid mode '{mode}'; expected keep|wait|abort"}
        with cond:
            state["paused"] = True
            if mode == "wait" and not cond.wait_for(lambda: state["running"] == 0, timeout=300):
                return {"status": "error", "message": "requests did not drain within 300 s"}
        return {"status": "ok", "message": "Engine paused", "mode": mode, "clear_cache": bool(body.get("clear_cache"))}

    def resume_generation(body: Any) -> dict:
        with cond:
            state["paused"] = False
            cond.notify_all()
        return {"status": "ok", "message": "Engine resumed"}

    def init_group(body: Any) -> dict:
        rpc = body.get("engine_rpc", "init_broadcaster")
        if rpc != "init_weight_transfer_engine":
            return {"status": "error", "message": f"engine rpc {rpc!r} is not modelled (init_weight_transfer_engine is)"}
        info = body.get("init_info") or {}
        state["group"] = info.get("group_name", GROUP)
        try:
            model.join_group(master_address=info["master_address"], master_port=int(info["master_port"]),
                             rank=int(info["rank_offset"]), world_size=int(info["world_size"]),
                             group_name=info.get("group_name", GROUP),
                             backend=args.weight_transfer_backend)
        except Exception as exc:  # noqa: BLE001 - the handler reports the engine's error
            return {"status": "error", "message": f"{type(exc).__name__}: {exc}"}
        return {"status": "ok", "message": "Weight update group initialized"}

    def destroy_group(body: Any) -> dict:
        model.leave_group(state["group"])
        return {"status": "ok", "message": "Weight update group destroyed"}

    def update_distributed(body: Any) -> dict:
        allow_unpaused, reset = body.get("allow_unpaused", False), body.get("reset_prefix_cache", True)
        if not isinstance(allow_unpaused, bool) or not isinstance(reset, bool):
            return {"status": "error", "message": "'allow_unpaused' and 'reset_prefix_cache' must be booleans"}
        if allow_unpaused and reset:
            return {"status": "error", "message": "Unpaused weight updates cannot reset the prefix cache."}
        if not state["paused"] and not allow_unpaused:
            return {"status": "error", "message": "Worker must be paused via pause_generation() before updating weights."}
        rpc = body.get("engine_rpc", "update_weights_from_path")
        try:
            if rpc == "start_weight_update":
                state["updating"] = True
            elif rpc == "update_weights":
                if not state["updating"]:
                    raise RuntimeError("update_weights before start_weight_update")
                info = body["update_info"]
                if info.get("packed"):
                    raise RuntimeError("packed transfer is not modelled by the stand-in")
                model.receive(info["names"], info["dtype_names"], info["shapes"], state["group"])
            elif rpc == "finish_weight_update":
                if not state["updating"]:
                    raise RuntimeError("finish_weight_update before start_weight_update")
                state["updating"] = False
            else:
                raise AttributeError(f"worker has no method {rpc!r}")
        except Exception as exc:  # noqa: BLE001
            return {"status": "error", "message": f"{type(exc).__name__}: {exc}"}
        version = body.get("weight_version", "unknown")
        if not args.ignore_weight_version:
            state["version"] = version
        return {"status": "ok", "version": version}

    def engine(handler):
        def route(body: Any, query: dict) -> dict:
            if body is not None and not isinstance(body, dict):
                return {"status": "error", "message": "request body must be a JSON object"}
            return handler(body or {})
        return route

    def inject(body: Any, query: dict) -> dict:
        state["failures"][body["path"]] = body
        return {"ok": True}

    routes = {
        ("GET", "/v1/models"): models, ("POST", "/v1/completions"): completions, ("GET", "/health"): health,
        ("POST", "/standin/fail"): inject,
    }
    for name, handler in {"pause_generation": pause_generation, "resume_generation": resume_generation,
                          "flush_cache": lambda b: {"status": "ok", "message": "Cache flushed"},
                          "get_weight_version": lambda b: {"status": "ok", "version": state["version"]},
                          "init_weights_update_group": init_group, "destroy_weights_update_group": destroy_group,
                          "update_weights_from_distributed": update_distributed,
                          "update_weights_from_tensor": lambda b: {"status": "error", "message":
                                                                   "update_weights_from_tensor is not implemented"},
                          }.items():
        wrapped = engine(handler)

        def failing(body: Any, query: dict, _wrapped=wrapped, _path=f"/engine/{name}") -> dict:
            fail_if_asked(_path)
            return _wrapped(body, query)
        routes[("POST", f"/engine/{name}")] = failing
    return routes


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model-name", default=None)
    parser.add_argument("--weight-transfer-backend", default="gloo")
    parser.add_argument("--ignore-weight-version", action="store_true")


if __name__ == "__main__":
    main(build_routes, add_arguments)
