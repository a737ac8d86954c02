"""What every stand-in engine server shares: a real model behind it, a JSON HTTP server, a launcher.

The stand-ins (``sglang_server``, ``trtllm_server``, ``dynamo_server`` in this folder) speak each
engine's wire protocol (its routes, payloads and response shapes, each checked against the
engine's source and docs, cited in the module) on top of ``EngineModel``: a real transformers
model sampled by grpo-sdk's hf generation loop, so the token ids, the processed logprobs, the
weight reloads and the version checks the adapters see are real computations over real HTTP.

They are NOT the engines: no continuous batching, no paged KV cache, no CUDA graphs, no tensor
parallel workers, and their throughput means nothing. A test passing against one proves that an
adapter speaks the protocol as written in the engine's source, not that the engine behaves so.

A stand-in runs in a subprocess of its own (as the real servers do): a torch process group is
registered by name per process, so the engine side of a weight-update group cannot share the
trainer's process.

    server = start_server("sglang_server", model_dir)     # server.url: "http://127.0.0.1:PORT"
    server.stop()
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

import attrs

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 120.0  # import torch + transformers, load the model: seconds on a busy 2-core machine
REQUEST_TIMEOUT_S = 120.0  # a connection idle this long is dropped, so a stuck client cannot hang a test


# --- the model ----------------------------------------------------------------------------------------


@attrs.frozen
class Completion:
    tokens: list[int]
    logprobs: list[float]  # of each sampled token under the distribution it was sampled from
    finish_reason: str  # "stop" (EOS or a stop token, included) or "length"
    weight_version: int


class EngineModel:
    """A tiny transformers model sampled by the hf backend's loop; weights by name, by file, or by
    a broadcast from a trainer's process group."""

    def __init__(self, model_dir: str, *, seed: int = 0):
        import torch

        from grpo_sdk.backends.hf.generation import HFGeneration
        from grpo_sdk.config.loading import load_config
        from grpo_sdk.plugins import RunContext
        from grpo_sdk.plugins.registry import Registry

        torch.set_num_threads(1)
        cfg = load_config(None, [f"policy.model_name={model_dir}"], Registry.discover())
        context = RunContext(config=cfg, run_dir=model_dir, model_path=model_dir, tokenizer_path=model_dir,
                             device="cpu", seed=seed, needs_reference=False)
        self.hf = HFGeneration(None, context)
        self.pad_token_id = self.hf.pad_token_id
        self.eos_token_id = self.hf.eos_token_id
        self.groups: dict[str, Any] = {}
        self.released = False  # release_memory_occupation / sleep: generating now is the adapter's bug

    @property
    def weight_version(self) -> int:
        return self.hf.weight_version

    def generate(self, rows: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int | None = None, stop_token_ids: tuple[int, ...] = (), seed: int | None = None
                 ) -> list[Completion]:
        import torch

        from grpo_sdk.plugins import GenerationInput, SamplingParams

        if self.released:
            raise RuntimeError("the engine's memory is released; resume it before generating")
        width = max(len(row) for row in rows)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        out = self.hf.generate(GenerationInput(input_ids=input_ids, attention_mask=mask), SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k or None,
            stop_token_ids=tuple(stop_token_ids), seed=seed))
        return [Completion(tokens=out.response_ids[i, :n].tolist(), logprobs=out.logprobs[i, :n].tolist(),
                           finish_reason="length" if bool(out.truncated[i]) else "stop",
                           weight_version=out.weight_version)
                for i, n in enumerate(out.response_lengths.tolist())]

    def load_tensors(self, named: list[tuple[str, Any]], *, version: int | None = None) -> None:
        self.hf.update_weights(named, version=self.weight_version if version is None else version)

    def load_directory(self, path: str, *, version: int | None = None) -> int:
        """Every ``*.safetensors`` file in ``path`` (as a model directory is read); the tensor count."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")
        named = [item for f in files for item in load_file(str(f)).items()]
        self.load_tensors(named, version=version)
        return len(named)

    def join_group(self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                   backend: str, timeout_s: float = 60.0) -> None:
        from grpo_sdk.plugins.toolkit import join_process_group

        self.groups[group_name] = join_process_group(
            backend=backend, master_address=master_address, master_port=master_port, world_size=world_size,
            rank=rank, group_name=group_name, timeout_s=timeout_s)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                *, version: int | None = None) -> None:
        """One broadcast from rank 0 per tensor, in order (what the engines' routes do), then load."""
        import torch
        import torch.distributed as dist

        group = self.groups.get(group_name)
        if group is None:
            raise KeyError(f"no weight-update group named {group_name!r}; call init first")
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
            dist.broadcast(tensor, src=0, group=group)
            received.append((name, tensor))
        self.load_tensors(received, version=version)

    def leave_group(self, group_name: str) -> None:
        from grpo_sdk.plugins.toolkit import leave_process_group

        group = self.groups.pop(group_name, None)
        if group is not None:
            leave_process_group(group)


# --- the HTTP server ------------------------------------------------------------------------------


class HTTPFailure(Exception):
    """Answer with this status and message (the engines answer 400 for a bad request)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


Route = Callable[[Any, dict[str, list[str]]], Any]  # (JSON body or None, query) -> JSON-able reply


def serve(routes: dict[tuple[str, str], Route], *, port: int = 0) -> ThreadingHTTPServer:
    """A threaded server on 127.0.0.1 (a pause request must get through while a generate runs)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S

        def _dispatch(self, method: str) -> None:
            url = urlparse(self.path)
            route = routes.get((method, url.path))
            if route is None:
                return self._reply(404, {"detail": "Not Found"})
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except json.JSONDecodeError as exc:
                return self._reply(400, {"error": f"invalid JSON: {exc}"})
            try:
                reply = route(body, parse_qs(url.query))
            except HTTPFailure as exc:
                return self._reply(exc.status, {"error": str(exc)})
            except Exception as exc:  # noqa: BLE001 - the engines answer 500 with the message
                return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            self._reply(200, reply)

        def _reply(self, status: int, reply: Any) -> None:
            data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's names
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        # http.server listens with a backlog of 5 and resets the connections beyond it; an adapter
        # sends a request per prompt row at once, as it would to an engine's frontend.
        request_queue_size = 256

    return Server(("127.0.0.1", port), Handler)


def main(build_routes: Callable[[EngineModel, argparse.Namespace], dict[tuple[str, str], Route]],
         add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """A stand-in's ``__main__``: ``--model DIR [--port N]``; prints ``PORT <n>`` once it serves."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    model = EngineModel(args.model, seed=args.seed)
    server = serve(build_routes(model, args), port=args.port)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


# --- the launcher (the tests' side) ----------------------------------------------------------------------


@attrs.define
class ServerProcess:
    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_server(module: str, model_dir: str | os.PathLike, *args: str,
                 timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
    """``python -m engine_servers.<module> --model model_dir *args`` on a free port; waits (bounded)
    for it to serve, or raises with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", f"engine_servers.{module}", "--model", str(model_dir), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    found: list[int] = []

    def read() -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            if line.startswith("PORT ") and not found:
                found.append(int(line.split()[1]))
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not found and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not found:
        server = ServerProcess(url="", process=process)
        server.stop()
        raise RuntimeError(f"the {module} stand-in did not start within {timeout_s:g} s:\n" + "".join(lines[-40:]))
    return ServerProcess(url=f"http://127.0.0.1:{found[0]}", process=process)
