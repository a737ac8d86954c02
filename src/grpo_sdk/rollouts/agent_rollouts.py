"""Rollouts an agent plays: episodes built from the rollout endpoint's recorded sessions.

For an environment that ``RunsAgents`` (docs/agents.md) the trainer does not play the turns
itself. It opens the rollout endpoint over its generation backend (one per backend, on a port
kept for the whole run), gives the environment one ``AgentTask`` per rollout, each with its own
session URL, and waits while the agents talk to the endpoint. Then each episode is built from
the tokens the endpoint recorded for its session (or that the agent handed back, NeMo-Gym's
output items): the first turn's prompt is the episode's prompt, every turn's generation is
trained on (``generated``), and what lies between two turns (tool results, the template's text
around them) is context, not trained on. The episode is exactly the tokens the model saw and
sampled, never re-tokenised text.

A session whose turns are not one chain (the agent rewrote its history or held two conversations
in it), one with no turns, an agent that raised or ran out of time, or a reward that is not a
finite number: the rollout fails, and ``env.on_reward_error`` masks it or stops the run naming it.
"""

from __future__ import annotations

import math
import threading
import uuid
import weakref
from typing import Any, Sequence

import attrs

from grpo_sdk.core.agents import AgentResult, AgentTask, EndpointConfig
from grpo_sdk.core.errors import EnvironmentStepError, GrpoSdkError
from grpo_sdk.core.records import Message, SamplingParams
from grpo_sdk.serving.sessions import SessionLog, Turn

_OPEN: dict[int, Any] = {}
_OPEN_LOCK = threading.Lock()


@attrs.define(eq=False)
class ServedEndpoint:
    endpoint: Any
    server: Any
    engine: Any

    def stop(self) -> None:
        self.server.stop()
        self.engine.stop()


def endpoint_for(generation: Any, tokenizer: Any, config: EndpointConfig, max_total_tokens: int) -> ServedEndpoint:
    """The rollout endpoint over ``generation``, started on first use and kept until ``close_endpoints``
    (or until the backend is garbage-collected)."""
    from grpo_sdk.serving.endpoint import Endpoint, EndpointSettings
    from grpo_sdk.serving.engine import GenerationEngine
    from grpo_sdk.serving.server import RolloutServer

    with _OPEN_LOCK:
        served = _OPEN.get(id(generation))
        if served is not None:
            return served
        engine = GenerationEngine(generation, pad_token_id=tokenizer.pad_token_id, max_queue=config.max_queue)
        settings = EndpointSettings(model_name=config.model_name, sampling="run", max_total_tokens=max_total_tokens,
                                    request_timeout_s=config.request_timeout_s, tool_parser=config.tool_parser)
        endpoint = Endpoint(engine, tokenizer, settings)
        try:
            server = RolloutServer(endpoint, host=config.host, port=config.port, api_key=config.api_key,
                                   max_connections=config.max_connections)
        except OSError as exc:
            raise GrpoSdkError(f"the rollout endpoint cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
                               " (env.<name>.endpoint.host/port; port 0 picks a free one)") from None
        engine.start()
        engine.close()  # serving only while a batch of agents runs
        server.start()
        served = _OPEN[id(generation)] = ServedEndpoint(endpoint, server, engine)
        weakref.finalize(generation, _close, id(generation))
        return served


def _close(key: int) -> None:
    with _OPEN_LOCK:
        served = _OPEN.pop(key, None)
    if served is not None:
        served.stop()


def close_endpoints() -> None:
    """Stop every endpoint this process opened (the trainer's shutdown)."""
    for key in list(_OPEN):
        _close(key)


def play_agents(episodes: list[Any], prompts: Sequence[Any], *, environment: Any, generation: Any, tokenizer: Any, sampling: SamplingParams,
                max_total_tokens: int, on_error: str, env_name: str, group_offset: int,
                group_size: int) -> tuple[list[str], dict[str, float]]:
    """Have the environment's agents play every episode (``prompts[i]`` is episode i's ``Prompt``);
    fill the episodes from their sessions. Returns the reward components' names and the metrics (``agent/...`` and the agents' own)."""
    served = endpoint_for(generation, tokenizer, environment.endpoint, max_total_tokens)
    endpoint, server = served.endpoint, served.server
    # The run's sampling, with no seed: requests are batched as they arrive, so a seed would not
    # make a batch reproducible anyway.
    endpoint.settings = attrs.evolve(endpoint.settings, defaults=attrs.evolve(sampling, seed=None))
    overridden = endpoint.sampling_overridden
    sessions = [f"{uuid.uuid4().hex[:16]}-{i}" for i in range(len(episodes))]
    api_key = environment.endpoint.api_key or "EMPTY"
    tasks = [AgentTask(session_id=session, base_url=server.session_url(session), endpoint_url=server.base_url,
                       api_key=api_key, model=endpoint.settings.model_name, prompt=p.text,
                       messages=None if p.messages is None else tuple(dict(m) for m in p.messages),
                       row=dict(e.metadata),
                       max_tokens=sampling.max_new_tokens, timeout_s=getattr(environment, "timeout_s", 600.0),
                       group=group_offset + i // group_size, index=i % group_size)
             for i, (e, p, session) in enumerate(zip(episodes, prompts, sessions))]
    generation.prepare_for_generation()
    served.engine.open()
    try:
        results = environment.run_agents(tasks)
    finally:
        served.engine.close()
        taken = [endpoint.sessions.take(s) for s in sessions]  # also what a failed agent left
    generation.finish_generation()
    if len(results) != len(tasks):
        raise EnvironmentStepError(f"environment {env_name!r}: run_agents returned {len(results)} results for "
                                   f"{len(tasks)} tasks; it must return one per task, in order")
    names: set[str] = set()
    sums: dict[str, float] = {}
    reported: dict[str, int] = {}
    counts = {"agent/failed": 0, "agent/no_turns": 0, "agent/broken_sessions": 0}
    for episode, task, result, recorded in zip(episodes, tasks, results, taken):
        failure = _fill(episode, task, result, recorded, tokenizer, counts)
        if failure is not None:
            counts["agent/failed"] += 1
            if on_error == "raise":
                raise EnvironmentStepError(
                    f"environment {env_name!r}: the agent's rollout of {episode.source} (group {task.group}, rollout "
                    f"{task.index}, session {task.session_id}) failed: {failure}. Set env.on_reward_error=mask "
                    "to leave failed rollouts out of the loss instead") from failure
            episode.failure = failure
            continue
        names.update(result.rewards)
        for key, value in result.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            reported[key] = reported.get(key, 0) + 1
    metrics = {k: v / reported[k] for k, v in sums.items()}  # over the rollouts that reported it
    batch_metrics = getattr(environment, "last_metrics", None)  # the batch's own (ReportsMetrics: NeMo-Gym's)
    if isinstance(batch_metrics, dict):
        metrics.update({k: float(v) for k, v in batch_metrics.items()})
    metrics.update({k: float(v) for k, v in counts.items()})
    metrics["agent/sampling_overridden"] = float(endpoint.sampling_overridden - overridden)
    return sorted(names) or ["reward"], metrics


def _turns(result: AgentResult, recorded: list[Turn]) -> list[Turn]:
    """The agent's turns, or the session's. A turn the agent hands back that the endpoint recorded in
    the session (the same prompt and generated ids) is the recorded one: it carries what the agent's
    copy does not (the endpoint's flags such as invalid_tool_call, weight versions, finish reason)."""
    if result.turns is None:
        return recorded
    known = {(t.prompt_ids, t.generation_ids): t for t in recorded}
    turns = []
    for i, raw in enumerate(result.turns):
        try:
            generated = tuple(int(t) for t in raw["generation_token_ids"])
            logprobs = tuple(float(x) for x in raw["generation_log_probs"])
            turns.append(Turn(prompt_ids=tuple(int(t) for t in raw["prompt_token_ids"]), generation_ids=generated,
                              logprobs=logprobs, versions=(int(raw.get("weight_version", 0)),) * len(generated),
                              finish_reason=raw.get("finish_reason", "stop"), text=str(raw.get("text", "")),
                              flags=tuple(raw.get("flags", ()))))
        except (KeyError, TypeError, ValueError) as exc:
            raise GrpoSdkError(f"the agent's turn {i + 1} is not prompt_token_ids / generation_token_ids / "
                               f"generation_log_probs lists ({type(exc).__name__}: {exc})") from None
        if len(turns[-1].logprobs) != len(generated):
            raise GrpoSdkError(f"the agent's turn {i + 1} has {len(generated)} generated tokens but "
                               f"{len(turns[-1].logprobs)} logprobs")
        turns[-1] = known.get((turns[-1].prompt_ids, generated), turns[-1])
    return turns


def _fill(episode: Any, task: AgentTask, result: Any, recorded: list[Turn], tokenizer: Any, counts: dict[str, int]) -> BaseException | None:
    """Build the episode from its turns and record its rewards; the failure, if it failed."""
    if isinstance(result, BaseException):
        return result
    if not isinstance(result, AgentResult):
        return GrpoSdkError(f"run_agents gave a {type(result).__name__}, not an AgentResult or an exception")
    try:
        turns = _turns(result, recorded)
    except GrpoSdkError as exc:
        return exc
    if not turns:
        counts["agent/no_turns"] += 1
        return GrpoSdkError("the agent made no request to the endpoint in its session (did it use the task's "
                            "base_url, or send the session id?)")
    chain, broken = SessionLog.chain(turns)
    if broken is not None:
        counts["agent/broken_sessions"] += 1
        return GrpoSdkError(f"its session is not one conversation: {broken}")
    for name, value in result.rewards.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            return GrpoSdkError(f"reward component {name!r} is {value!r}, not a finite number")
    flags = result.flags
    episode.prompt_ids = list(chain[0].prompt_ids)
    episode.log = [Message(role="user", content=task.prompt, token_ids=tuple(chain[0].prompt_ids))]
    episode.tokens, episode.generated, episode.logprobs, episode.versions = [], [], [], []
    for i, turn in enumerate(chain):
        if i:
            between = list(turn.prompt_ids[len(chain[i - 1].context):])
            episode.tokens += between
            episode.generated += [False] * len(between)
            episode.logprobs += [0.0] * len(between)
            episode.versions += [episode.versions[-1] if episode.versions else 0] * len(between)
            if between:
                episode.log.append(Message(role="environment", content=tokenizer.decode(between), token_ids=tuple(between)))
        episode.tokens += turn.generation_ids
        episode.generated += [True] * len(turn.generation_ids)
        episode.logprobs += turn.logprobs
        episode.versions += turn.versions
        turn_flags = tuple(dict.fromkeys((*turn.flags, *(flags[i] if flags and i < len(flags) else ()))))
        episode.log.append(Message(role="assistant", content=turn.text, token_ids=turn.generation_ids,
                                   generation_logprobs=turn.logprobs, flags=turn_flags))
    episode.truncated = chain[-1].finish_reason == "length"
    episode.rewards = {k: float(v) for k, v in result.rewards.items() if v is not None}
    episode.scored = bool(episode.rewards)
    if result.info:
        episode.metadata = {**episode.metadata, "agent": result.info}
    episode.done = True
    return None
