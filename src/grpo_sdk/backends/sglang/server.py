"""Server mode: a running SGLang server (``python -m sglang.launch_server``) over HTTP.

Every route, body and reply below was read in SGLang 0.5.23's ``sglang/srt/entrypoints/http_server.py``
and the request structs of ``sglang/srt/managers/io_struct.py`` (tests/backends/test_sglang.py pins the
fields against that wheel):

* ``POST /generate`` (``GenerateReqInput``), a list of per-prompt dicts back;
* ``POST /update_weights_from_tensor`` (``serialized_named_tensors`` as base64 strings,
  ``load_format``, ``flush_cache``, ``weight_version``), ``POST /update_weights_from_disk``
  (``model_path``, ``weight_version``), ``POST /init_weights_update_group``,
  ``POST /update_weights_from_distributed``, ``POST /destroy_weights_update_group``: each answers
  ``{"success", "message"}``, HTTP 400 when ``success`` is false;
* ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` (``tags``; the server runs
  with ``--enable-memory-saver``); the cache is flushed by the update requests' ``flush_cache``;
* ``POST /pause_generation`` (``mode``: abort, retract, in_place) and ``/continue_generation``;
* ``GET /model_info``: ``weight_version`` (0.5.23 has no ``/get_weight_version`` route; earlier
  releases did), ``GET /server_info``: the resolved server arguments (``tp_size``, ``pp_size``).

Which SGLang features a route needs on the server's side (memory saver, ``--skip-tokenizer-init``)
is in docs/sglang.md.
"""

from __future__ import annotations

import base64
from typing import Any

from grpo_sdk.plugins import PluginError
from grpo_sdk.plugins.toolkit import HTTPClient

URL_KEY = "policy.generation.sglang.url"


class SGLangServer:
    """The engine operations the backend uses, as HTTP calls to one server."""

    def __init__(self, url: str, *, request_timeout_s: float, control_timeout_s: float):
        self.url = url.rstrip("/")
        self.http = HTTPClient(self.url, timeout_s=control_timeout_s, what=URL_KEY)
        self.request_timeout_s = request_timeout_s
        info = self.http.get("/server_info")  # also: is it up at all (a clear error when it is not)
        if not isinstance(info, dict):
            raise PluginError(f"GET {self.url}/server_info answered {info!r}: is {url} an SGLang server?")
        self.parallel_ranks = int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)
        self.memory_saver = bool(info.get("enable_memory_saver", False))

    # --- sampling ------------------------------------------------------------------------------------

    def generate(self, request: dict[str, Any]) -> Any:
        return self.http.post("/generate", request, timeout_s=self.request_timeout_s)

    # --- weights -------------------------------------------------------------------------------------

    def update_weights_from_tensor(self, payloads: list[bytes], *, load_format: str | None, flush_cache: bool,
                                   weight_version: str | None) -> None:
        body: dict[str, Any] = {"serialized_named_tensors": [base64.b64encode(p).decode() for p in payloads],
                                "load_format": load_format, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        self._expect_success("/update_weights_from_tensor", body)

    def update_weights_from_disk(self, model_path: str, *, weight_version: str) -> None:
        self._expect_success("/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version,
                                                           "flush_cache": True})

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        self._expect_success("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool, weight_version: str | None) -> None:
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        self._expect_success("/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._expect_success("/destroy_weights_update_group", {"group_name": group_name})

    def weight_version(self) -> str | None:
        info = self.http.get("/model_info")
        return None if not isinstance(info, dict) else info.get("weight_version")

    # --- colocation and refits ----------------------------------------------------------------------

    def release_memory_occupation(self) -> None:
        self.http.post("/release_memory_occupation", {"tags": None})

    def resume_memory_occupation(self) -> None:
        self.http.post("/resume_memory_occupation", {"tags": None})

    def pause_generation(self, mode: str) -> None:
        self.http.post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.http.post("/continue_generation", {})

    def shutdown(self) -> None:
        pass  # the server is not ours to stop

    def _expect_success(self, path: str, body: dict[str, Any]) -> None:
        # A failed update answers HTTP 400 (HTTPClient raises with the server's message); a 200 whose
        # success is false would be a server bug, refused the same way rather than trusted.
        reply = self.http.post(path, body)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise PluginError(f"POST {self.url}{path} failed: {reply.get('message')}")
