"""TensorRT-LLM generation against a running trtllm-serve, over HTTP (``policy.generation.trtllm.mode: server``).

The routes, payloads and reply shapes are trtllm-serve's own, read in NVIDIA/TensorRT-LLM's
``tensorrt_llm/serve/openai_server.py`` (``register_routes``; the 124 kB version of the file in the
index, commit e7f7345e), ``serve/openai_protocol.py`` (``CompletionRequest``, ``CompletionResponse``,
``MemoryUpdateRequest``, ``UpdateWeightsRequest``, ``ErrorResponse``) and
``serve/postprocess_handlers.py`` (``completion_response_post_processor``):

* ``POST /v1/completions``: ``prompt`` a list of token ids (or a list of such lists: one engine
  request each, answered as ``choices[prompt_index * n + i]``), ``detokenize: false`` so each choice
  carries ``token_ids``, ``logprobs: 1`` so it carries ``logprobs.token_logprobs`` (one float per
  token), ``finish_reason`` ``"stop"``/``"length"``. Every sampling field applies to every prompt of
  a request, and each row needs its own seed, so each row is a request of its own.
* ``POST /update_weights {"weights": {...} | null}``, ``POST /release_memory`` and
  ``POST /resume_memory {"tags": [...]}``, all answering ``{"status": "success"}``; ``GET /health``.

trtllm-serve has no weight-version route and its ``/update_weights`` drops the workers' results, so
here a weight update that failed is seen as the route's error status only (docs/trtllm.md). Its
logprobs are RAW (``LogprobMode.RAW``, TensorRT-LLM's default; no request field changes it), which
is why the config check refuses filtered sampling in this mode unless told otherwise.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from grpo_sdk.backends.trtllm.config import TrtllmConfig
from grpo_sdk.backends.trtllm.base import Completion, TrtllmGeneration, row_seeds
from grpo_sdk.backends.trtllm.refit import command
from grpo_sdk.plugins import GrpoSdkError, PluginError, RunContext, SamplingParams
from grpo_sdk.plugins.toolkit import HTTPClient

URL_KEY = "policy.generation.trtllm.url"
HEALTH_TIMEOUT_S = 10.0
MAX_CONCURRENT = 16  # requests in flight per generate call; the server batches them


class TrtllmServerGeneration(TrtllmGeneration, mode="server"):
    def __init__(self, config: TrtllmConfig | None, context: RunContext):
        super().__init__(config, context)
        if not self.config.url:
            raise PluginError(f"{URL_KEY} is not set; server mode needs the trtllm-serve URL")
        self.client = HTTPClient(self.config.url, timeout_s=self.config.request_timeout_s, what=URL_KEY)
        self.client.get("/health", timeout_s=HEALTH_TIMEOUT_S)  # fail at setup, not at the first generate
        self.model_name = context.model_path
        if self.config.reload_on_start and self.config.worker_extension:
            self.reload_model_files()

    def reload_model_files(self) -> None:
        """The run's starting weights into the server (it may hold another run's): every safetensors
        file of the model directory, one load_file command each, the last finishing the update."""
        files = sorted(Path(self.context.model_path).glob("*.safetensors"))
        if not files:
            raise PluginError(f"policy.generation.trtllm.reload_on_start: no *.safetensors file in "
                              f"{self.context.model_path} to load into the server; set reload_on_start=false if the "
                              "server was started fresh from this model")
        for i, path in enumerate(files):
            self._update(command("load_file", path=str(path.absolute()), version=0, last=i == len(files) - 1))

    # --- sampling ----------------------------------------------------------------------------------

    def _complete(self, rows: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        # A request's sampling fields (its seed too) apply to each of its prompts, and every row
        # needs a seed of its own (row_seeds): one request per row, several in flight at once.
        seeds = row_seeds(sampling, len(rows), self.rng)
        with ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT, len(rows)) or 1) as pool:
            parts = pool.map(lambda i: self._request([rows[i]], self.sampling_fields(sampling, seeds[i])),
                             range(len(rows)))
            return [completion for part in parts for completion in part]

    def _request(self, rows: list[list[int]], fields: dict[str, Any]) -> list[Completion]:
        fields = {k: v for k, v in fields.items() if v is not None}
        body = {"model": self.model_name, "prompt": rows if len(rows) > 1 else rows[0], "n": 1, **fields}
        reply = self.client.post("/v1/completions", body)
        choices = sorted(_field(reply, "choices", "/v1/completions"), key=lambda c: c["index"])
        if len(choices) != len(rows):
            raise GrpoSdkError(f"POST {self.config.url}/v1/completions answered {len(choices)} choices for "
                               f"{len(rows)} prompts")
        out = []
        for choice in choices:
            tokens = choice.get("token_ids")
            if tokens is None:
                raise GrpoSdkError(f"POST {self.config.url}/v1/completions returned no token_ids (is detokenize=false "
                                   "reaching the server?)")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if logprobs is None:
                raise GrpoSdkError(f"POST {self.config.url}/v1/completions returned no logprobs.token_logprobs")
            out.append((list(tokens), [float(x) for x in logprobs], choice.get("finish_reason") or "stop"))
        return out

    # --- weights and memory ------------------------------------------------------------------------

    def _update(self, weights: dict[str, str] | None, *, op: str | None = None, version: int | None = None,
                tensors: int | None = None) -> None:
        reply = self.client.post("/update_weights", {"weights": weights})
        _check_status(reply, "/update_weights", self.config.url)

    def _release(self, tags: Sequence[str]) -> None:
        _check_status(self.client.post("/release_memory", {"tags": list(tags)}), "/release_memory", self.config.url)

    def _resume(self, tags: Sequence[str]) -> None:
        _check_status(self.client.post("/resume_memory", {"tags": list(tags)}), "/resume_memory", self.config.url)


def _field(reply: Any, name: str, route: str) -> Any:
    if not isinstance(reply, dict) or name not in reply:
        raise GrpoSdkError(f"{route} answered {str(reply)[:300]!r}, without {name!r}")
    return reply[name]


def _check_status(reply: Any, route: str, url: str | None) -> None:
    """trtllm-serve's RL routes answer ``{"status": "success"}``; anything else is a failure."""
    if not isinstance(reply, dict) or reply.get("status") != "success":
        raise GrpoSdkError(f"POST {url}{route} did not succeed: it answered {str(reply)[:300]!r}")
