"""Agents that run their own loop: the protocol between the trainer and an agent harness.

An environment that ``RunsAgents`` does not see turns one at a time (``Environment.step``): the
trainer gives it one ``AgentTask`` per rollout, each with the rollout endpoint's URL for that
rollout's session, and the environment runs whatever agent it wraps (a Python function, an HTTP
service, NeMo-Gym's agent servers) to the end. The agent talks to the policy only through the
endpoint, which records every turn's tokens; the environment hands back the reward
(``AgentResult``). The trainer then builds each episode from the session's recorded turns
(docs/agents.md). Light: no torch.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import attrs

from grpo_sdk.core.options import option


def _port(instance: Any, attribute: Any, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"{attribute.name} must be 0 (any free port) to 65535, got {value}")


def _positive(instance: Any, attribute: Any, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen(kw_only=True)
class EndpointConfig:
    """How the trainer serves the rollout endpoint to agents (a block of each agent environment's config)."""

    host: str = option("127.0.0.1", "Address the endpoint listens on. Anything but loopback needs api_key.")
    port: int = option(0, "Port; 0 picks a free one (agents get the URL in their task).", validator=_port)
    api_key: str | None = option(None, "Bearer token every request must carry; required when host is not "
                                 "loopback. null: none (loopback only).")
    model_name: str = option("policy", "The model name the endpoint answers to (/v1/models).")
    tool_parser: str = option("hermes", "How tool calls are read from a turn when a request has tools: "
                              "'hermes' (<tool_call>{json}</tool_call>) or 'module:Class'. A malformed call "
                              "flags the turn invalid_tool_call.")
    request_timeout_s: float = option(300.0, "Deadline of one request (queue + generation); past it: HTTP 504.",
                                      validator=_positive)
    max_queue: int = option(4096, "Requests that may wait for generation; beyond: HTTP 429.", validator=_positive)
    max_connections: int = option(1024, "Requests served at once; beyond: HTTP 429.", validator=_positive)


@attrs.frozen(kw_only=True)
class AgentTask:
    """One rollout for an agent to play.

    ``base_url`` is an OpenAI-compatible base URL that already names the rollout's session
    (``http://127.0.0.1:PORT/sessions/<session_id>/v1``): an agent written with any framework passes
    it as its ``base_url`` and changes nothing else. ``endpoint_url`` is the same endpoint without
    the session (a client that sends the session itself: header ``X-Session-Id`` or field
    ``session_id``).
    """

    session_id: str
    base_url: str
    endpoint_url: str
    api_key: str  # the bearer token to send ("EMPTY" when the endpoint needs none)
    model: str
    prompt: str  # the prompt text, templates applied (what a single-turn rollout would be shown)
    messages: tuple[dict[str, Any], ...] | None  # a conversational row's messages, as written
    row: dict[str, Any]  # the row's other keys (the task: answer, tests, tool set...)
    max_tokens: int  # per turn (policy.generation.max_new_tokens)
    timeout_s: float  # the agent's deadline for the whole rollout
    group: int  # the prompt group: the G rollouts of one prompt share it
    index: int  # this rollout's place in the group, 0..G-1

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class AgentResult:
    """What an agent's rollout earned.

    ``rewards`` as an environment returns them: one or more named components, a None component
    meaning "no reward" for this rollout. ``turns`` lets an agent that captured its tokens itself
    (NeMo-Gym's output items) hand them over: a list of ``{"prompt_token_ids", "generation_token_ids",
    "generation_log_probs"}``; None: the trainer takes the session's turns from the endpoint.
    """

    rewards: dict[str, float | None]
    metrics: dict[str, float] = attrs.field(factory=dict)
    turns: list[dict[str, Any]] | None = None
    flags: tuple[tuple[str, ...], ...] | None = None  # per turn, for an agent that judges turns itself
    info: dict[str, Any] = attrs.field(factory=dict)  # kept in the episode's metadata under "agent"


@runtime_checkable
class RunsAgents(Protocol):
    """An environment whose rollouts an agent plays end to end over the rollout endpoint.

    ``run_agents`` gets every task of a generation batch at once and returns, in order, an
    ``AgentResult`` or the exception that rollout ended with (the trainer masks it or raises, as
    ``env.on_reward_error`` says). It bounds its own concurrency and each task's ``timeout_s``.
    ``endpoint`` says how the trainer should serve the endpoint for it (``EndpointConfig``).

    Example (the built-in harness, ``env.name: agent``)::

        class AgentHarness:
            endpoint = EndpointConfig()
            def run_agents(self, tasks):
                return [AgentResult(rewards={"reward": my_agent(t)}) for t in tasks]
    """

    endpoint: Any

    def run_agents(self, tasks: Sequence[AgentTask]) -> list[AgentResult | BaseException]: ...
