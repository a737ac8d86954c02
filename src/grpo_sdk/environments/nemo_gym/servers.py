"""NeMo-Gym's servers as grpo-sdk runs them: three processes in NeMo-Gym's own Python, no Ray.

``GymServers.start(base_url, api_key, model)`` starts the model server (NeMo-Gym's ``vllm_model``,
pointed at grpo-sdk's rollout endpoint), the resources server and the agent server, each its
app.py under ``gym_apps/launch.py``, with the one config dict they share (``NEMO_GYM_CONFIG_DICT``:
every server finds the others by the host and port written there). It waits, bounded, until each
answers ``GET /``; one that exits or does not answer in time stops them all and raises an error
naming it with the end of its log. ``stop()`` (also at interpreter exit) sends SIGTERM to each
process group, then SIGKILL; and a server whose grpo-sdk process is gone exits by itself.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.plugins import GrpoSdkError
from grpo_sdk.plugins.toolkit import free_port

APPS = Path(__file__).resolve().parent / "gym_apps"
MODEL, RESOURCES, AGENT = "grpo_policy_model", "grpo_resources", "grpo_agent"  # the config dict's top-level keys
LOG_TAIL_LINES = 30


class GymServerError(GrpoSdkError):
    """A NeMo-Gym server did not start, or stopped."""


@attrs.frozen(kw_only=True)
class ServerSpec:
    key: str  # the top-level key of the config dict (the server's runtime name)
    kind: str  # responses_api_models | resources_servers | responses_api_agents
    implementation: str  # the block's name under the kind (vllm_model, simple_agent, ...)
    app: str  # what launch.py starts: a path to an app.py, or a NeMo-Gym package holding one
    role: str  # for messages: "model server", "resources server", "agent server"
    fields: dict[str, Any] = attrs.field(factory=dict)


def resources_spec(resources: str, extra: dict[str, Any]) -> ServerSpec:
    """``builtin:calculator``, a NeMo-Gym resources server's name, or an app.py's path."""
    if resources.startswith("builtin:"):
        app, implementation = str(APPS / f"{resources.removeprefix('builtin:')}.py"), \
            f"grpo_{resources.removeprefix('builtin:')}"
    elif resources.endswith(".py"):
        path = Path(resources).expanduser().resolve()
        app, implementation = str(path), path.parent.name or "resources"
    else:
        app, implementation = f"resources_servers.{resources}", resources
    return ServerSpec(key=RESOURCES, kind="resources_servers", implementation=implementation, app=app,
                      role=f"resources server ({resources})", fields={"domain": "agent", **extra})


def agent_spec(agent: str, max_steps: int, extra: dict[str, Any]) -> ServerSpec:
    if agent.endswith(".py"):
        path = Path(agent).expanduser().resolve()
        app, implementation = str(path), path.parent.name or "agent"
    else:
        app, implementation = f"responses_api_agents.{agent}", agent
    return ServerSpec(key=AGENT, kind="responses_api_agents", implementation=implementation, app=app,
                      role=f"agent server ({agent})",
                      fields={"max_steps": max_steps,
                              "resources_server": {"type": "resources_servers", "name": RESOURCES},
                              "model_server": {"type": "responses_api_models", "name": MODEL}, **extra})


def model_spec(base_url: str, api_key: str, model: str, extra: dict[str, Any]) -> ServerSpec:
    # return_token_id_information: each turn's prompt/generation ids and logprobs come back on Gym's
    # output items, and are sent back to the endpoint on the next turn (it continues those tokens).
    return ServerSpec(key=MODEL, kind="responses_api_models", implementation="vllm_model",
                      app="responses_api_models.vllm_model", role="model server (vllm_model)",
                      fields={"base_url": base_url, "api_key": api_key, "model": model,
                              "return_token_id_information": True, "uses_reasoning_parser": False, **extra})


def config_dict(specs: list[ServerSpec], ports: dict[str, int], host: str = "127.0.0.1") -> dict[str, Any]:
    """The global config every server reads (``NEMO_GYM_CONFIG_DICT``)."""
    config: dict[str, Any] = {"head_server": {"host": host, "port": free_port()},  # read, never contacted
                              "dry_run": False}
    for spec in specs:
        block = {"entrypoint": "app.py", "host": host, "port": ports[spec.key], **spec.fields}
        config[spec.key] = {spec.kind: {spec.implementation: block}}
    return config


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    tail = text.rstrip().splitlines()[-lines:]
    return "\n".join("    " + line for line in tail) if tail else "    (empty)"


class GymServers:
    """Example::

        servers = GymServers(python, log_dir, [model_spec(url, "EMPTY", "policy", {}), resources_spec(...),
                                               agent_spec("simple_agent", 8, {})], startup_timeout_s=120)
        servers.start()
        servers.url(AGENT)        # "http://127.0.0.1:PORT": POST /run there
        servers.stop()
    """

    def __init__(self, python: Path, log_dir: Path, specs: list[ServerSpec], startup_timeout_s: float,
                 host: str = "127.0.0.1"):
        self.python, self.log_dir, self.specs = python, Path(log_dir), specs
        self.startup_timeout_s, self.host = startup_timeout_s, host
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.startup_s: float | None = None
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return f"http://{self.host}:{self.ports[key]}"

    def log(self, key: str) -> Path:
        return self.log_dir / f"{key}.log"

    def spec(self, key: str) -> ServerSpec:
        return next(s for s in self.specs if s.key == key)

    def start(self) -> None:
        with self._lock:
            if self.procs:
                return
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.ports = {s.key: free_port() for s in self.specs}
            config = json.dumps(config_dict(self.specs, self.ports, self.host))
            env = {**os.environ, "NEMO_GYM_CONFIG_DICT": config, "GRPO_SDK_PARENT_PID": str(os.getpid()),
                   "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "RAY_DISABLE_IMPORT_WARNING": "1"}
            for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):  # grpo-sdk's own Python's, not NeMo-Gym's
                env.pop(name, None)
            atexit.register(self.stop)
            start = time.monotonic()
            try:
                for spec in self.specs:
                    with open(self.log(spec.key), "ab") as log:
                        self.procs[spec.key] = subprocess.Popen(
                            [str(self.python), "-u", str(APPS / "launch.py"), spec.app],
                            env={**env, "NEMO_GYM_CONFIG_PATH": spec.key}, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(self.log_dir))
                self._wait_ready(start)
            except BaseException:
                self._stop_locked()
                raise
            self.startup_s = time.monotonic() - start

    def _wait_ready(self, start: float) -> None:
        waiting = [s.key for s in self.specs]
        while waiting:
            for key in list(waiting):
                code = self.procs[key].poll()
                if code is not None:
                    raise GymServerError(self._describe(key, f"exited with code {code} while starting"))
                if self._answers(key):
                    waiting.remove(key)
            if not waiting:
                return
            if time.monotonic() - start > self.startup_timeout_s:
                raise GymServerError(self._describe(waiting[0], f"did not answer GET / within "
                                                                f"{self.startup_timeout_s:g} s "
                                                                "(env.nemo_gym.startup_timeout_s)"))
            time.sleep(0.1)

    def _answers(self, key: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url(key)}/", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _describe(self, key: str, what: str) -> str:
        spec = self.spec(key)
        return (f"NeMo-Gym's {spec.role} {what}; the end of its log ({self.log(key)}):\n{log_tail(self.log(key))}")

    def check_alive(self) -> None:
        """Raise naming a server that has stopped since it started."""
        for key, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                message = self._describe(key, f"stopped (exit code {code})")
                self.stop()
                raise GymServerError(message)

    def stop(self) -> None:
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        procs, self.procs = self.procs, {}
        for proc in procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 5
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        try:
            atexit.unregister(self.stop)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]
