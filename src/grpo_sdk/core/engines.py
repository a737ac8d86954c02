"""What a client of an inference engine needs from grpo-sdk: HTTP with deadlines, and the install check.

Re-exported by ``grpo_sdk.plugins.toolkit`` (public). Light: urllib only; torch is imported only
to ask whether a GPU is visible, and only when a check asks.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import urllib.error
import urllib.request
from typing import Any

from grpo_sdk.core.errors import GrpoSdkError, PluginError

ERROR_BODY_CHARS = 2000  # of a server's error reply, in the message: enough for a traceback's last lines


class HTTPClient:
    """JSON over HTTP to one server, every call under a deadline.

    ``what`` names the setting that holds the URL, for the error a dead server gives
    (``"policy.generation.sglang.url"``). Errors are ``GrpoSdkError`` (a run fails with exit 1):
    an HTTP error status names the method, URL and the server's own message; no answer within the
    deadline (refused, reset, timed out) says so and asks whether the server is running.

    Example::

        client = HTTPClient("http://127.0.0.1:30000", timeout_s=60, what="policy.generation.sglang.url")
        client.post("/generate", {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 8}})
        client.get("/get_weight_version", timeout_s=5)
    """

    def __init__(self, base_url: str, *, timeout_s: float, what: str):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.what = what

    def get(self, path: str, *, timeout_s: float | None = None) -> Any:
        return self.request("GET", path, timeout_s=timeout_s)

    def post(self, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        return self.request("POST", path, {} if body is None else body, timeout_s=timeout_s)

    def request(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        """The reply parsed as JSON (its text when it is not JSON; None when empty)."""
        url = self.base_url + path
        timeout = self.timeout_s if timeout_s is None else timeout_s
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:  # the server answered with an error: show its message
            detail = exc.read().decode(errors="replace")[:ERROR_BODY_CHARS]
            raise GrpoSdkError(f"{method} {url} failed: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, socket.timeout, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise GrpoSdkError(f"no answer from {method} {url} within {timeout:g} s ({reason}); is the server "
                               f"running? ({self.what})") from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")


def require_engine(module: str, install: str, *, gpu: bool = True) -> None:
    """For a backend's config check, when it would run ``module`` in this process: a ``PluginError``
    (exit code 3, before anything starts) with ``install`` when the module is not installed (found
    without importing it), and, when ``gpu``, one saying so when no CUDA device is visible."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, a broken __spec__
        found = False
    if not found:
        raise PluginError(f"{module} is not installed: {install}")
    if gpu:
        import torch

        if not torch.cuda.is_available():
            raise PluginError(f"{module} is installed but no NVIDIA GPU is visible to this process "
                              "(torch.cuda.is_available() is False); it runs on GPUs only. On a machine without one, "
                              "use its server mode against a server elsewhere, or policy.generation.backend=hf")
