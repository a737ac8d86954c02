"""The rollout endpoint over HTTP: OpenAI-compatible routes on a standard-library server.

Routes (``POST`` unless said): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/tokenize``, ``GET /v1/models``, ``GET /health``. A request belongs to a rollout session when
its path starts with ``/sessions/<id>`` (an agent's ``base_url`` of
``http://host:port/sessions/<id>/v1`` needs nothing else from its framework), when it has an
``X-Session-Id`` header, or a ``session_id`` (or ``rollout_id``) field in its body.

Safe by default: it binds to 127.0.0.1; bound anywhere else it refuses to start without an API
key, and with one every request must carry ``Authorization: Bearer <key>`` (401 otherwise).
Bounded: at most ``max_connections`` requests at once (429 beyond), bodies up to 16 MiB (413),
each request answered within its deadline (504), the engine's queue bounded (429).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from grpo_sdk.core.errors import ConfigError
from grpo_sdk.serving.endpoint import Endpoint
from grpo_sdk.serving.engine import DeadlineExceeded, EngineBusy, EngineClosed
from grpo_sdk.serving.openai_api import BadRequest

MAX_BODY = 16 * 1024 * 1024
_SESSION_PATH = re.compile(r"^/sessions/([A-Za-z0-9._:-]{1,200})(/.*)$")
_STATUS = {BadRequest: (400, "invalid_request_error"), EngineBusy: (429, "rate_limit_error"),
           EngineClosed: (503, "service_unavailable"), DeadlineExceeded: (504, "timeout")}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RolloutServer:
    """Example::

        server = RolloutServer(endpoint, port=0)          # a free port on 127.0.0.1
        server.start()
        server.base_url                                   # "http://127.0.0.1:41235/v1"
        server.session_url("rollout-17")                  # ".../sessions/rollout-17/v1": give it to the agent
        server.stop()
    """

    def __init__(self, endpoint: Endpoint, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_connections: int = 512, log_requests: bool = False):
        if not is_loopback(host) and not api_key:
            raise ConfigError([("host", f"the rollout endpoint would listen on {host!r}, beyond this machine, "
                                        "without an API key: set one (api_key) or bind to 127.0.0.1")])
        self.endpoint = endpoint
        self.api_key = api_key
        self.log_requests = log_requests
        self._slots = threading.BoundedSemaphore(max_connections)
        self.counts: dict[str, int] = {}
        self._counts_lock = threading.Lock()
        self._httpd = _Listener((host, port), _handler_for(self))
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return self._httpd.server_address[0]

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def root_url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def session_url(self, session: str) -> str:
        return f"{self.root_url}/sessions/{session}/v1"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="grpo-endpoint-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:  # shutdown() waits for serve_forever: forever when it never ran
            self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def count(self, key: str) -> None:
        with self._counts_lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    # --- one request -------------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers: Any, body: bytes | None) -> tuple[int, dict[str, Any]]:
        if self.api_key is not None:
            given = headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return 401, _error(401, "authentication_error", "a valid 'Authorization: Bearer <key>' header is required")
        session = headers.get("X-Session-Id") or None
        match = _SESSION_PATH.match(path)
        if match:
            session, path = match.group(1), match.group(2)
        path = path.split("?", 1)[0].rstrip("/") or "/"
        if method == "GET":
            if path in ("/v1/models", "/models"):
                return 200, self.endpoint.models()
            if path == "/health":
                return 200, {"status": "ok" if self.endpoint.engine.is_open else "closed",
                             "queued": self.endpoint.engine.queued}
            return 404, _error(404, "not_found", f"no route GET {path}")
        routes = {"/v1/chat/completions": self.endpoint.chat, "/v1/completions": self.endpoint.completions,
                  "/v1/responses": self.endpoint.responses}
        if path not in routes and path not in ("/tokenize", "/v1/tokenize"):
            return 404, _error(404, "not_found", f"no route POST {path}")
        try:
            payload = json.loads(body or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return 400, _error(400, "invalid_request_error", f"the body is not JSON: {exc}")
        if not isinstance(payload, dict):
            return 400, _error(400, "invalid_request_error", "the body must be a JSON object")
        session = session or payload.get("session_id") or payload.get("rollout_id")
        if session is not None and not isinstance(session, str):
            return 400, _error(400, "invalid_request_error", "'session_id' must be a string")
        if self.log_requests:
            print(f"grpo-sdk endpoint: POST {path} session={session}", file=sys.stderr, flush=True)
        if not self._slots.acquire(blocking=False):
            return 429, _error(429, "rate_limit_error", "too many requests at once; retry later")
        try:
            if path in routes:
                return 200, routes[path](payload, session)
            return 200, self.endpoint.tokenize(payload)
        except tuple(_STATUS) as exc:
            status, kind = _STATUS[type(exc)]
            return status, _error(status, kind, str(exc))
        except Exception as exc:  # noqa: BLE001 - the backend failed: the agent gets a 500 with the reason
            return 500, _error(500, "server_error", f"{type(exc).__name__}: {exc}")
        finally:
            self._slots.release()


class _Listener(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: the default 5 resets connections when 128 agents start at once


def _error(status: int, kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def _handler_for(server: RolloutServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: an agent's client reuses its connection
        server_version = "grpo-sdk-endpoint"
        timeout = 120  # seconds a connection may sit idle or trickle its body: a slow client cannot pin a thread
        # Headers and body go out in two writes: with Nagle's algorithm on, a keep-alive client's
        # delayed ACK stalled every answer ~40 ms (benchmarks/endpoint_overhead.py measured it).
        disable_nagle_algorithm = True

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            server.count(f"http_{status}")

        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            self._answer(*server.handle("GET", self.path, self.headers, None))

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY:
                self.close_connection = True
                self._answer(413, _error(413, "invalid_request_error", f"the body must be 0..{MAX_BODY} bytes"))
                return
            self._answer(*server.handle("POST", self.path, self.headers, self.rfile.read(length)))

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet; log_requests prints
            pass

    return Handler
