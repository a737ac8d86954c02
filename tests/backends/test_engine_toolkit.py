"""The toolkit's engine helpers: ``HTTPClient`` against real HTTP servers (errors, deadlines) and
``require_engine`` through ``grpoctl`` (a check that finds the engine missing exits 3 with the
install line, before anything starts)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_sdk.core.errors import GrpoSdkError, PluginError
from grpo_sdk.plugins.toolkit import HTTPClient, require_engine


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/echo":
            data, status = json.dumps({"got": body}).encode(), 200
        elif self.path == "/text":
            data, status = b"plain words", 200
        elif self.path == "/slow":
            time.sleep(5)
            data, status = b"{}", 200
        else:
            data, status = b'{"error": "unknown weight model.layers.99.mlp"}', 400
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_reply_is_parsed_json_or_text(server):
    client = HTTPClient(server + "/", timeout_s=10, what="x.url")
    assert client.post("/echo", {"input_ids": [[1, 2]]}) == {"got": {"input_ids": [[1, 2]]}}
    assert client.post("/text") == "plain words"


def test_an_error_status_names_the_route_and_shows_the_servers_message(server):
    with pytest.raises(GrpoSdkError, match=r"POST http://127\.0\.0\.1:\d+/update failed: HTTP 400: "
                                           r".*unknown weight model\.layers\.99\.mlp"):
        HTTPClient(server, timeout_s=10, what="x.url").post("/update", {})


def test_a_server_that_does_not_answer_in_time_is_a_clear_error_within_the_deadline(server):
    start = time.monotonic()
    with pytest.raises(GrpoSdkError, match=r"no answer from POST .*/slow within 0\.5 s .*is the server running\? "
                                           r"\(policy\.generation\.acme\.url\)"):
        HTTPClient(server, timeout_s=60, what="policy.generation.acme.url").post("/slow", timeout_s=0.5)
    assert time.monotonic() - start < 4


def test_nothing_listening_is_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(GrpoSdkError, match=r"no answer from GET .* \(.*refused.*\); is the server running\? \(a\.url\)"):
        HTTPClient(f"http://127.0.0.1:{port}", timeout_s=5, what="a.url").get("/health")


def test_require_engine_names_the_install_line_or_the_missing_gpu():
    with pytest.raises(PluginError, match=r"no_such_engine_xyz is not installed: pip install 'grpo-sdk\[xyz\]'") as info:
        require_engine("no_such_engine_xyz", "pip install 'grpo-sdk[xyz]'")
    assert info.value.exit_code == 3
    import torch

    if torch.cuda.is_available():
        require_engine("json", "pip install json")
    else:
        with pytest.raises(PluginError, match="json is installed but no NVIDIA GPU is visible"):
            require_engine("json", "pip install json")
    require_engine("json", "pip install json", gpu=False)


ENGINE_SPEC = '''
import attrs
from grpo_sdk.plugins import ComponentSpec, option
from grpo_sdk.plugins.toolkit import require_engine

@attrs.frozen(kw_only=True)
class AcmeConfig:
    mode: str = option("server", "server or engine")

def check(config, options, registry):
    if options.mode == "engine":
        require_engine("acme_engine_not_here", "pip install 'acme-engine>=2'")
    return []

GENERATION = ComponentSpec(name="acme", kind="generation", impl="acme_gen.spec:Nothing",
                           config="acme_gen.spec:AcmeConfig", check="acme_gen.spec:check")
'''


def test_a_check_that_finds_the_engine_missing_exits_3_with_the_install_line(fake_site):
    fake_site.add("acme-gen", entry_points={"grpo_sdk.generation": {"acme": "acme_gen.spec:GENERATION"}},
                  files={"acme_gen/__init__.py": "", "acme_gen/spec.py": ENGINE_SPEC})
    engine = fake_site.grpoctl("config", "validate", "policy.generation.backend=acme",
                               "policy.generation.acme.mode=engine")
    assert engine.returncode == 3, engine.stdout + engine.stderr
    assert ("policy.generation.acme: acme_engine_not_here is not installed: pip install 'acme-engine>=2'"
            in engine.stderr)
    assert "Traceback" not in engine.stderr
    server = fake_site.grpoctl("config", "validate", "policy.generation.backend=acme")
    assert server.returncode == 0, server.stdout + server.stderr
