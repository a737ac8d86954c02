"""Stand-in for ``trtllm-serve`` (TensorRT-LLM's OpenAI-compatible server) with grpo-sdk's worker extension.

Routes, payloads and replies follow NVIDIA/TensorRT-LLM's own source (main, as stored in the index):
``tensorrt_llm/serve/openai_server.py`` (``register_routes``; the RL-only routes ``/release_memory``,
``/resume_memory``, ``/update_weights``, ``/server_info``), ``serve/openai_protocol.py``
(``CompletionRequest``: ``prompt`` ids or list of ids, ``max_tokens``, ``temperature``, ``top_p``,
``top_k`` (0 = off), ``seed``, ``stop_token_ids``, ``include_stop_str_in_output``, ``logprobs``,
``detokenize``; ``CompletionResponseChoice``: ``index``, ``text``, ``token_ids`` (when
``detokenize`` is false), ``logprobs`` = ``CompletionLogProbs(text_offset, token_logprobs, tokens,
top_logprobs)``, ``finish_reason``, ``stop_reason``; ``MemoryUpdateRequest.tags``;
``UpdateWeightsRequest.weights: Optional[Dict[str, str]]``) and ``serve/postprocess_handlers.py``
(``completion_response_post_processor``, ``create_completion_logprobs``: ``logprobs`` must be truthy).

What it mirrors of the engine's behaviour, and where that was read:
* each prompt is one engine request with the request's sampling fields; ``seed`` None is the
  runtime default 0 (``tensorrt_llm/sampling_params.py`` docstring), so requests without a seed draw
  the same stream;
* logprobs are RAW (``LogprobMode.RAW``, the default): the log-softmax of the unprocessed logits,
  recomputed here with a forward pass when sampling is filtered (at temperature 1 without top-k/p
  they equal the sampling distribution's);
* the stop token is dropped from ``token_ids`` unless ``include_stop_str_in_output`` (NeMo-RL sets it
  "to keep the EOS / stop token in the returned token_ids");
* ``/update_weights`` with a ``"grpo_sdk"`` command calls ``update_weights`` of grpo-sdk's real
  ``GrpoWorkerExtension`` (as trtllm-serve's ``collective_rpc`` would), mixed here onto the FAKE
  upstream ``WorkerExtension`` with a fake executor whose ``model_loader.reload`` loads into the
  model; upstream IPC handles are refused (no GPU here);
* ``/release_memory`` then generating fails (HTTP 500), as a released engine cannot serve.

Not mirrored: error bodies are the stand-in base's ``{"error": ...}`` (trtllm-serve answers
``ErrorResponse{object, message, type, param, code}``); ``text``/``tokens`` hold token ids as strings
(no detokenizer); ``n`` > 1, streaming, chat. ``--exit-in-generate`` makes the process die inside a
completion (a server crash mid-call).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from engine_servers.base import EngineModel, HTTPFailure, main


def raw_logprobs(model: EngineModel, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each token's logprob under the model's unprocessed next-token distribution (LogprobMode.RAW)."""
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model.hf.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def extension_worker(model: EngineModel) -> Any:
    """grpo-sdk's ``GrpoWorkerExtension`` (the real class) as one engine worker of this process: its
    upstream bases come from the FAKE ``tensorrt_llm`` (tests/engine_fakes), its ``engine`` is a fake
    executor whose ``model_loader.reload`` loads into the stand-in's real model."""
    from engine_fakes import fake_tensorrt_llm as fake

    fake.install()
    from grpo_sdk.backends.trtllm.worker_extension import GrpoWorkerExtension

    worker = type("StandInRayGPUWorker", (GrpoWorkerExtension,), {})()
    worker.engine = fake.FakeExecutor(model.hf.model)
    worker.device_id = 0
    return worker


def build_routes(model: EngineModel, args: Any) -> dict:
    from grpo_sdk.backends.trtllm.refit import parse_command

    lock = threading.Lock()  # one engine: requests and weight changes take turns
    worker = extension_worker(model)

    def completions(body: Any, query: Any) -> dict:
        if not isinstance(body, dict) or "prompt" not in body or "model" not in body:
            raise HTTPFailure(400, "CompletionRequest needs 'model' and 'prompt'")
        prompt = body["prompt"]
        prompts = [prompt] if prompt and isinstance(prompt[0], int) else prompt
        if not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
            raise HTTPFailure(400, "the stand-in serves token-id prompts only")
        if body.get("detokenize", True) or body.get("stream") or body.get("n", 1) != 1:
            raise HTTPFailure(400, "the stand-in serves detokenize=false, stream=false, n=1 only")
        if args.exit_in_generate:
            os._exit(1)
        temperature = body.get("temperature") if body.get("temperature") is not None else 1.0
        top_p = body.get("top_p") if body.get("top_p") is not None else 1.0
        top_k = int(body.get("top_k") or 0)
        stops = tuple(body.get("stop_token_ids") or ())
        seed = body.get("seed") if body.get("seed") is not None else 0  # the runtime default
        choices = []
        with lock:
            for index, ids in enumerate(prompts):
                done = model.generate([ids], max_new_tokens=int(body.get("max_tokens") or 16),
                                      temperature=temperature, top_p=top_p, top_k=top_k or None,
                                      stop_token_ids=stops, seed=seed)[0]
                tokens, logprobs = list(done.tokens), list(done.logprobs)
                if temperature != 1.0 or top_p < 1.0 or top_k:
                    logprobs = raw_logprobs(model, ids, tokens)
                stop_reason = None
                if done.finish_reason == "stop" and tokens:
                    stop_reason = tokens[-1] if tokens[-1] in stops else None
                    if not body.get("include_stop_str_in_output"):
                        tokens, logprobs = tokens[:-1], logprobs[:-1]
                choice = {"index": index, "text": "", "token_ids": tokens, "finish_reason": done.finish_reason,
                          "stop_reason": stop_reason, "logprobs": None}
                if body.get("logprobs"):
                    offsets = list(range(len(tokens)))
                    choice["logprobs"] = {"text_offset": offsets, "token_logprobs": logprobs,
                                          "tokens": [str(t) for t in tokens],
                                          "top_logprobs": [{str(t): lp} for t, lp in zip(tokens, logprobs)]}
                choices.append(choice)
        used = sum(len(c["token_ids"]) for c in choices)
        return {"id": "cmpl-standin", "object": "text_completion", "model": body["model"], "choices": choices,
                "usage": {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": used,
                          "total_tokens": used + sum(map(len, prompts))}}

    def update_weights(body: Any, query: Any) -> dict:
        weights = (body or {}).get("weights")
        try:
            command = parse_command(weights)
        except ValueError as exc:
            raise HTTPFailure(400, str(exc)) from None
        if command is None:
            if weights is None:
                return {"status": "success"}  # upstream's finalise after IPC loads: nothing pending here
            raise HTTPFailure(500, "CUDA IPC handles need a GPU: the stand-in has none (upstream "
                              "WorkerExtension.update_weights rebuilds CUDA tensors from them)")
        if command["op"] == "join":  # the join blocks until rank 0 joins; it must not hold the engine
            worker.update_weights(weights)
        else:
            with lock:
                reply = worker.update_weights(weights)
                if command.get("last", True) and reply.get("version") is not None:
                    model.hf.weight_version = reply["version"]
        return {"status": "success"}  # what trtllm-serve answers: the worker's reply is dropped

    def memory(released: bool):
        def route(body: Any, query: Any) -> dict:
            tags = (body or {}).get("tags")
            if not tags:
                raise HTTPFailure(422, "MemoryUpdateRequest.tags needs at least one tag")
            with lock:
                model.released = released
            return {"status": "success"}
        return route

    return {
        ("GET", "/health"): lambda body, query: b"",
        ("GET", "/version"): lambda body, query: {"version": "stand-in"},
        ("GET", "/server_info"): lambda body, query: {"disaggregated_params": None, "max_batch_size": 64},
        ("POST", "/v1/completions"): completions,
        ("POST", "/update_weights"): update_weights,
        ("POST", "/release_memory"): memory(True),
        ("POST", "/resume_memory"): memory(False),
    }


def add_arguments(parser: Any) -> None:
    parser.add_argument("--exit-in-generate", action="store_true", help="die inside /v1/completions")


if __name__ == "__main__":
    main(build_routes, add_arguments)
