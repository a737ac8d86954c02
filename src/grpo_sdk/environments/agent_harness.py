"""The agent harness: train an agent you already have, whatever framework it is written with.

``env.name: agent`` with ``env.agent.agent`` naming it:

* ``'module:function'`` (the module importable from the current directory or an installed
  package): called as ``function(task)`` with an ``AgentTask`` in a thread pool, or awaited when
  it is a coroutine function (one event loop for all, the better choice for hundreds of agents);
* ``'http://...'`` / ``'https://...'``: the task is POSTed there as JSON (``AgentTask.to_json``).

The agent talks to the policy at ``task.base_url`` (an OpenAI-compatible endpoint that names the
rollout's session: the openai SDK, LangChain, curl, anything that takes a base URL) and returns
its reward: a number, a dict of named components, ``{"reward": ..., "metrics": {...}}``, or an
``AgentResult``. The trainer builds the episode from the tokens the endpoint recorded for the
session (``rollouts.agent_rollouts``). Each rollout has ``timeout_s``; at most ``max_concurrency``
run at once. A rollout that raises, times out or returns no usable reward fails, and
``env.on_reward_error`` decides what that does.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from grpo_sdk.plugins import AgentResult, AgentTask, GrpoSdkError


class AgentTimeout(GrpoSdkError):
    """The agent did not finish its rollout within env.agent.timeout_s."""


def as_result(value: Any) -> AgentResult:
    """An agent's return value as an ``AgentResult``."""
    if isinstance(value, AgentResult):
        return value
    if isinstance(value, bool) or value is None:
        raise GrpoSdkError(f"the agent returned {value!r}; return a reward (a number), a dict of named reward "
                           "components, {'reward': x, 'metrics': {...}}, or an AgentResult")
    if isinstance(value, (int, float)):
        return AgentResult(rewards={"reward": float(value)})
    if isinstance(value, dict):
        if "reward" in value or "rewards" in value or "metrics" in value:
            rewards = value.get("rewards", {"reward": value.get("reward")})
            if not isinstance(rewards, dict):
                raise GrpoSdkError(f"'rewards' must be a dict of named components, got {type(rewards).__name__}")
            return AgentResult(rewards=dict(rewards), metrics=dict(value.get("metrics") or {}),
                               info={k: v for k, v in value.items() if k not in ("reward", "rewards", "metrics")})
        return AgentResult(rewards=dict(value))
    raise GrpoSdkError(f"the agent returned a {type(value).__name__}; return a number, a dict or an AgentResult")


class AgentHarness:
    """Example::

        # my_agent.py
        from openai import OpenAI
        def run(task):
            client = OpenAI(base_url=task.base_url, api_key=task.api_key)
            reply = client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": task.prompt}])
            return float(reply.choices[0].message.content.strip() == task.row["answer"])

        # grpoctl run env.name=agent env.agent.agent=my_agent:run data.train.path=tasks.jsonl
    """

    def __init__(self, config: Any, context: Any):
        from grpo_sdk.environments.specs import AgentHarnessConfig

        self.config = config = config or AgentHarnessConfig()
        self.endpoint = config.endpoint
        self.timeout_s = config.timeout_s
        self._agent: Any = None
        self._lock = threading.Lock()

    def step(self, message_logs: Any, metadata: Any) -> Any:
        raise GrpoSdkError("the agent environment is played by its agents over the rollout endpoint "
                           "(run_agents), not stepped turn by turn")

    # --- RunsAgents ----------------------------------------------------------------------------------

    def run_agents(self, tasks: Sequence[AgentTask]) -> list[AgentResult | BaseException]:
        target = self.config.agent
        if target.startswith(("http://", "https://")):
            return self._in_threads(tasks, lambda task: self._post(target, task))
        agent = self._resolve()
        if inspect.iscoroutinefunction(agent):
            return self._in_event_loop(tasks, agent)
        return self._in_threads(tasks, agent)

    def _resolve(self) -> Any:
        with self._lock:
            if self._agent is None:
                from grpo_sdk.environments.callables import resolve

                self._agent = resolve(self.config.agent, "env.agent.agent")
            return self._agent

    def _in_threads(self, tasks: Sequence[AgentTask], call: Any) -> list[AgentResult | BaseException]:
        """Daemon threads, not a ThreadPoolExecutor: the interpreter joins an executor's threads at
        exit, so one stuck agent would hang the process; a daemon thread is abandoned instead."""
        results: list[AgentResult | BaseException | None] = [None] * len(tasks)
        queue = list(enumerate(tasks))
        lock, finished = threading.Lock(), threading.Semaphore(0)

        def work() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    i, task = queue.pop(0)
                try:
                    results[i] = as_result(call(task))
                except BaseException as exc:  # noqa: BLE001 - the rollout's failure, judged by env.on_reward_error
                    results[i] = exc
                finished.release()

        for n in range(min(self.config.max_concurrency, len(tasks))):
            threading.Thread(target=work, name=f"grpo-agent-{n}", daemon=True).start()
        # Each rollout has timeout_s and they start in waves of max_concurrency: past that many
        # deadlines the rollouts still running are abandoned as timed out.
        deadline = time.monotonic() + self.timeout_s * math.ceil(len(tasks) / max(self.config.max_concurrency, 1))
        for _ in tasks:
            if not finished.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        with lock:
            queue.clear()  # rollouts not started by now never start
        timeout = AgentTimeout(f"the agent did not finish within {self.timeout_s:g} s (env.agent.timeout_s)")
        return [timeout if r is None else r for r in results]

    def _in_event_loop(self, tasks: Sequence[AgentTask], agent: Any) -> list[AgentResult | BaseException]:
        async def one(task: AgentTask, slots: asyncio.Semaphore) -> AgentResult | BaseException:
            async with slots:
                try:
                    return as_result(await asyncio.wait_for(agent(task), self.timeout_s))
                except asyncio.TimeoutError:
                    return AgentTimeout(f"the agent did not finish within {self.timeout_s:g} s (env.agent.timeout_s)")
                except Exception as exc:  # noqa: BLE001
                    return exc

        async def all_tasks() -> list[AgentResult | BaseException]:
            slots = asyncio.Semaphore(self.config.max_concurrency)
            return list(await asyncio.gather(*(one(t, slots) for t in tasks)))

        return asyncio.run(all_tasks())

    def _post(self, url: str, task: AgentTask) -> AgentResult:
        request = urllib.request.Request(url, data=json.dumps(task.to_json()).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            raise GrpoSdkError(f"the agent at {url} answered HTTP {exc.code}: "
                               f"{exc.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise GrpoSdkError(f"the agent at {url} could not be reached: {getattr(exc, 'reason', exc)}") from None
        try:
            return as_result(json.loads(body))
        except json.JSONDecodeError:
            raise GrpoSdkError(f"the agent at {url} answered with something that is not JSON: {body[:200]!r}") from None
