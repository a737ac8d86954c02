"""NeMo-Gym's wire format: a rollout's task as the agent's ``/run`` body, its answer as an ``AgentResult``.

``/run`` takes a dataset row as NeMo-Gym's JSONL has it: ``responses_create_params`` (the Responses
API request: ``input``, ``tools``...) and the task's own fields (``expected_answer``...), which the
agent forwards to the resources server's ``/seed_session`` and ``/verify``. It answers with
``/verify``'s response: ``reward``, optionally ``reward_components`` and other fields, and the whole
``response``, whose output items carry each model call's ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs`` (on the last item of the call): the turns
grpo-sdk trains on. Pure functions, no I/O.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Sequence

from grpo_sdk.plugins import AgentResult, AgentTask, GrpoSdkError

RCP = "responses_create_params"
TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
TASK_INDEX, ROLLOUT_INDEX = "_ng_task_index", "_ng_rollout_index"  # NeMo-Gym's rollout collection's keys


def run_request(task: AgentTask) -> dict[str, Any]:
    """The ``/run`` body of one rollout: the row (its ``responses_create_params`` as written, or one
    built from the prompt), with the rollout's session id for the endpoint.

    The session id rides in ``metadata.extra_body``, which NeMo-Gym's vllm_model merges into every
    chat-completions request of the rollout (a JSON string, as OpenAI metadata values are): the
    endpoint records the rollout's turns under it, with the flags it sets (``invalid_tool_call``).
    """
    body = copy.deepcopy(task.row)
    params = body.get(RCP)
    if params is None:
        messages = list(task.messages) if task.messages is not None else [{"role": "user", "content": task.prompt}]
        params = {"input": [{"role": m["role"], "content": m["content"]} for m in messages]}
    elif not isinstance(params, dict):
        raise GrpoSdkError(f"the row's {RCP!r} must be an object (NeMo-Gym's Responses API request), "
                           f"got {type(params).__name__}")
    metadata = dict(params.get("metadata") or {})
    try:
        extra = json.loads(metadata.get("extra_body") or "{}")
    except json.JSONDecodeError:
        raise GrpoSdkError(f"the row's {RCP}.metadata.extra_body is not a JSON string") from None
    metadata["extra_body"] = json.dumps({**extra, "session_id": task.session_id})
    body[RCP] = {**params, "metadata": metadata}
    return body


def turns_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    """Each model call's tokens, in order: the output items that carry them."""
    turns = []
    for item in response.get("output") or ():
        if isinstance(item, dict) and item.get("generation_token_ids") is not None:
            turns.append({k: item.get(k) for k in TOKEN_KEYS})
    return turns


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def agent_result(verified: Any, *, use_reward_components: bool, row_keys: Sequence[str] = ()) -> AgentResult:
    """``/run``'s answer as the rollout's result: the reward (or the named reward components), the
    turns from the output items, the numeric fields ``/verify`` added (not the row's own:
    ``row_keys``) as metrics (``verify/...``)."""
    if not isinstance(verified, dict) or not isinstance(verified.get("response"), dict):
        raise GrpoSdkError("the agent's /run answer has no 'response' (not a NeMo-Gym verify response)")
    reward = verified.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise GrpoSdkError(f"/verify gave reward {reward!r}, not a number")
    components = verified.get("reward_components")
    if components is not None and not isinstance(components, dict):
        raise GrpoSdkError(f"/verify gave reward_components {components!r}, not an object of named numbers")
    if use_reward_components:
        if not components:
            raise GrpoSdkError("env.nemo_gym.use_reward_components is true, but /verify gave no reward_components")
        rewards = {str(k): v for k, v in components.items()}
    else:
        rewards = {"reward": float(reward)}
    metrics = {}
    for key, value in verified.items():
        number = _number(value)
        if number is not None and key not in ("reward", TASK_INDEX, ROLLOUT_INDEX) and key not in row_keys:
            metrics[f"verify/{key}"] = number
    if components and not use_reward_components:
        for key, value in components.items():
            number = _number(value)
            if number is not None:
                metrics[f"verify/reward_components/{key}"] = number
    turns = turns_of(verified["response"])
    usage = verified["response"].get("usage") or {}
    info = {"response_id": verified["response"].get("id"),
            "incomplete": (verified["response"].get("incomplete_details") or {}).get("reason")}
    if isinstance(usage, dict) and usage.get("output_tokens") is not None:
        info["output_tokens"] = usage["output_tokens"]
    return AgentResult(rewards=rewards, metrics=metrics, turns=turns, info=info)


def aggregate_request(verified: Sequence[dict[str, Any]], tasks: Sequence[AgentTask]) -> dict[str, Any]:
    """``/aggregate_metrics``'s body, stripped as NeMo-Gym's rollout collection strips it (no
    response or request, the response's usage kept)."""
    stripped = []
    for answer, task in zip(verified, tasks):
        entry = {k: v for k, v in answer.items() if k not in ("response", RCP)}
        usage = (answer.get("response") or {}).get("usage")
        if usage:
            entry["response"] = {"usage": usage}
        stripped.append({**entry, TASK_INDEX: task.group, ROLLOUT_INDEX: task.index})
    return {"verify_responses": stripped}


def key_metrics(aggregate: Any) -> dict[str, float]:
    """The numeric ``key_metrics`` of an ``/aggregate_metrics`` answer."""
    found = aggregate.get("key_metrics") if isinstance(aggregate, dict) else None
    return {f"aggregate/{k}": n for k, v in (found or {}).items() if (n := _number(v)) is not None}
