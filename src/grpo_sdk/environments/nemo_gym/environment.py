"""The ``nemo_gym`` environment: NeMo-Gym's own agent and resources servers play the rollouts.

On the first batch it starts NeMo-Gym's servers in their own Python (``servers.GymServers``): the
``vllm_model`` model server with the rollout endpoint as its ``base_url``, the resources server and
the agent. Every rollout's row is POSTed to the agent's ``/run`` (at most ``max_concurrency`` at
once, each within ``timeout_s``); the agent loops model calls (through the endpoint) and tool
calls (to the resources server), then returns ``/verify``'s answer: the reward, and the turns'
exact tokens on its output items, which become the episode (``protocol``). After each batch
``/aggregate_metrics`` is asked for its key metrics (logged as ``env/aggregate/...``). A rollout
whose ``/run`` fails or times out fails (``env.on_reward_error``); a server that stops stops the run.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from grpo_sdk.environments.nemo_gym import protocol
from grpo_sdk.environments.nemo_gym.servers import AGENT, GymServers, agent_spec, model_spec, resources_spec
from grpo_sdk.environments.nemo_gym_spec import NemoGymConfig, resolve_python
from grpo_sdk.plugins import AgentResult, AgentTask, GrpoSdkError

log = logging.getLogger(__name__)


class NemoGymTimeout(GrpoSdkError):
    """The agent's /run did not answer within env.nemo_gym.timeout_s."""


class NemoGymEnvironment:
    """Example::

        grpoctl run env.name=nemo_gym data.train_path=rows.jsonl \\
            env.nemo_gym.resources_server=example_multi_step    # or builtin:calculator, or path/to/app.py
    """

    def __init__(self, config: NemoGymConfig | None, context: Any):
        self.config = config = config or NemoGymConfig()
        self.endpoint = config.endpoint
        self.timeout_s = config.timeout_s
        self.last_metrics: dict[str, float] = {}
        if config.log_dir:
            self.log_dir = Path(config.log_dir).expanduser()
        elif context is not None and getattr(context, "run_dir", None) is not None:
            self.log_dir = Path(context.run_dir) / "nemo_gym"
        else:
            self.log_dir = Path(tempfile.mkdtemp(prefix="grpo-sdk-nemo-gym-"))
        self.servers: GymServers | None = None
        self._serving: tuple[str, str, str] | None = None
        self._started = False  # servers started for this batch: their start-up time is logged with it
        self._lock = threading.Lock()

    def step(self, message_logs: Any, metadata: Any) -> Any:
        raise GrpoSdkError("the nemo_gym environment is played by NeMo-Gym's agent server over the rollout "
                           "endpoint (run_agents), not stepped turn by turn")

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []  # each row brings its own tools (responses_create_params.tools), sent by the agent

    # --- the servers -----------------------------------------------------------------------------------

    def start(self, base_url: str, api_key: str, model: str) -> GymServers:
        """NeMo-Gym's servers, their model server calling ``base_url``; started once (again if it moves)."""
        with self._lock:
            if self.servers is not None and self._serving == (base_url, api_key, model):
                self.servers.check_alive()
                return self.servers
            if self.servers is not None:
                self.servers.stop()
            c = self.config
            specs = [model_spec(base_url, api_key, model, dict(c.model_server_config)),
                     resources_spec(c.resources_server, dict(c.resources_server_config)),
                     agent_spec(c.agent, c.max_steps, dict(c.agent_config))]
            servers = GymServers(resolve_python(c), self.log_dir, specs, c.startup_timeout_s)
            servers.start()
            log.info("NeMo-Gym servers up in %.1f s (logs: %s)", servers.startup_s, self.log_dir)
            self.servers, self._serving = servers, (base_url, api_key, model)
            self._started = True
            return servers

    def shutdown(self) -> None:
        with self._lock:
            if self.servers is not None:
                self.servers.stop()
            self.servers = None

    # --- RunsAgents ------------------------------------------------------------------------------------

    def run_agents(self, tasks: Sequence[AgentTask]) -> list[AgentResult | BaseException]:
        self.last_metrics = {}
        if not tasks:
            return []
        servers = self.start(tasks[0].endpoint_url, tasks[0].api_key, tasks[0].model)
        agent = servers.url(AGENT)
        answers = self._post_all(agent, tasks)
        servers.check_alive()  # a server that died mid-batch stops the run, named, rather than failing rollouts
        results: list[AgentResult | BaseException] = []
        for task, answer in zip(tasks, answers):
            if isinstance(answer, BaseException):
                results.append(answer)
                continue
            try:
                results.append(protocol.agent_result(answer, use_reward_components=self.config.use_reward_components,
                                                     row_keys=tuple(task.row)))
            except GrpoSdkError as exc:
                results.append(exc)
        metrics: dict[str, float] = {}
        if self._started and servers.startup_s is not None:
            metrics["servers/startup_s"], self._started = servers.startup_s, False
        verified = [(a, t) for a, t in zip(answers, tasks) if isinstance(a, dict)]
        if verified:
            metrics.update(self._aggregate(agent, [a for a, _ in verified], [t for _, t in verified]))
        self.last_metrics = metrics
        return results

    def _post_all(self, agent: str, tasks: Sequence[AgentTask]) -> list[Any]:
        answers: list[Any] = [NemoGymTimeout("not run")] * len(tasks)
        workers = min(self.config.max_concurrency, len(tasks))
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpo-nemo-gym")
        try:
            futures = {}
            for i, task in enumerate(tasks):
                try:
                    body = protocol.run_request(task)
                except GrpoSdkError as exc:
                    answers[i] = exc
                    continue
                futures[pool.submit(self._post, f"{agent}/run", body, self.timeout_s)] = i
            # One deadline for the batch: each /run has timeout_s, started together or as a slot frees.
            waves = math.ceil(len(tasks) / workers)
            done, _ = concurrent.futures.wait(futures, timeout=self.timeout_s * waves + 5)
            for future, i in futures.items():
                if future not in done:
                    answers[i] = NemoGymTimeout(f"the agent's /run did not answer within {self.timeout_s:g} s "
                                                "(env.nemo_gym.timeout_s)")
                    continue
                try:
                    answers[i] = future.result()
                except BaseException as exc:  # noqa: BLE001 - the rollout's failure, judged by env.on_reward_error
                    answers[i] = exc
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return answers

    @staticmethod
    def _post(url: str, body: dict[str, Any], timeout: float) -> Any:
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            raise GrpoSdkError(f"NeMo-Gym's agent answered /{url.rsplit('/', 1)[-1]} with HTTP {exc.code}: "
                               f"{detail}") from None
        except TimeoutError:
            raise NemoGymTimeout(f"the agent's /{url.rsplit('/', 1)[-1]} did not answer within {timeout:g} s "
                                 "(env.nemo_gym.timeout_s)") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise NemoGymTimeout(f"the agent's /{url.rsplit('/', 1)[-1]} did not answer within {timeout:g} s "
                                     "(env.nemo_gym.timeout_s)") from None
            raise GrpoSdkError(f"NeMo-Gym's agent at {url} could not be reached: {reason}") from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise GrpoSdkError(f"NeMo-Gym's agent answered {url} with something that is not JSON: "
                               f"{raw[:200]!r}") from None

    def _aggregate(self, agent: str, verified: list[dict[str, Any]], tasks: list[AgentTask]) -> dict[str, float]:
        try:
            answer = self._post(f"{agent}/aggregate_metrics", protocol.aggregate_request(verified, tasks),
                                min(self.timeout_s, 120.0))
        except GrpoSdkError as exc:
            log.warning("NeMo-Gym's /aggregate_metrics failed (the batch's aggregate metrics are left out): %s", exc)
            return {}
        return protocol.key_metrics(answer)
