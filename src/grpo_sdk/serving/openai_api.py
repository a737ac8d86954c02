"""The OpenAI wire format: requests to token ids and sampling parameters, turns to answers.

Three request shapes reach the same generation: chat completions (``messages``), completions
(``prompt``: text or token ids) and responses (``input``: text or items, ``instructions``). A
conversation is rendered by the tokenizer's chat template with the request's ``tools`` in its
tools section; without a chat template (the built-in tiny model) it is the messages' contents
one after another, as plain-text multi-turn environments continue (docs/multi-turn.md). Answers
carry, besides the text and tool calls, the exact tokens of the turn as NeMo-Gym expects them
(``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``) and the weight
version that sampled them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Sequence

import attrs

from grpo_sdk.core.errors import GrpoSdkError


class BadRequest(GrpoSdkError):
    """A request the endpoint cannot serve (HTTP 400), with a message that says what to change."""


@attrs.frozen(kw_only=True)
class Sampling:
    """What a request asked for; the endpoint decides what it honours (``Endpoint``)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    token_ids_as_text: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N"


def _number(body: dict[str, Any], key: str, kind: type, low: float | None = None, high: float | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise BadRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"'{key}' must be in [{low}, {high}], got {value!r}")
    return kind(value)


def sampling_of(body: dict[str, Any], max_tokens_keys: Sequence[str]) -> Sampling:
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("'n' must be 1: every sample is its own rollout session (send n requests)")
    if body.get("stream"):
        raise BadRequest("'stream' is not supported: the answer carries the turn's token ids, sent whole")
    max_tokens = next((_number(body, k, int, 1) for k in max_tokens_keys if body.get(k) is not None), None)
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a string or a list of non-empty strings")
    stop_ids = body.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("'stop_token_ids' must be a list of integers")
    top_k = _number(body, "top_k", int)
    return Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", float, 0.0, 100.0),
                    top_p=_number(body, "top_p", float, 0.0, 1.0), top_k=None if top_k in (None, -1, 0) else top_k,
                    seed=_number(body, "seed", int, 0, 2**63 - 1), stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                    logprobs=bool(body.get("logprobs")) or body.get("top_logprobs") is not None,
                    token_ids_as_text=bool(body.get("return_tokens_as_token_ids")))


# --- messages ------------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (``text``/``input_text``/``output_text``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(parts)
    raise BadRequest(f"{where}: 'content' must be a string or a list of text parts")


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):  # the OpenAI format carries arguments as a JSON string; templates want the object
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat-completions messages, checked, with text contents and tool-call arguments as objects."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'")
        role = "system" if message["role"] == "developer" else message["role"]
        item: dict[str, Any] = {"role": role, "content": _text(message.get("content"), f"messages[{i}]")}
        if message.get("tool_calls"):
            item["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                   "function": {"name": c.get("function", {}).get("name"),
                                                "arguments": _arguments(c.get("function", {}).get("arguments"))}}
                                  for c in message["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                item[key] = message[key]
        if role == "assistant" and message.get("generation_token_ids") is not None:
            item[TOKENS] = _token_fields(message, f"messages[{i}]")
        out.append(item)
    return out


TOKENS = "__grpo_tokens__"  # an assistant message's exact tokens, as a client sent them back (NeMo-Gym does)


def _token_fields(message: dict[str, Any], where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prompt_token_ids, generation_token_ids)`` of an assistant message that carries them."""
    try:
        prompt = tuple(int(t) for t in message.get("prompt_token_ids") or ())
        generated = tuple(int(t) for t in message["generation_token_ids"])
    except (TypeError, ValueError):
        raise BadRequest(f"{where}: prompt_token_ids and generation_token_ids must be lists of token ids") from None
    return prompt, generated


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != TOKENS} for m in messages]


def response_input(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses API's ``instructions`` and ``input`` (text, or message / function_call /
    function_call_output items) as chat messages."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"type": "function", "id": item.get("call_id"),
                    "function": {"name": item.get("name"), "arguments": _arguments(item.get("arguments"))}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            elif messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # the endpoint continues from the sampled tokens, which hold the reasoning
        else:
            raise BadRequest(f"input[{i}]: item type {kind!r} is not supported")
    return messages


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as the chat template wants them (``{"type": "function", "function": {...}}``), from
    either API's shape (the Responses API puts name and parameters at the top level)."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadRequest(f"tools[{i}] must be a function tool")
        function = tool.get("function", tool)
        if not isinstance(function.get("name"), str):
            raise BadRequest(f"tools[{i}] has no function name")
        out.append({"type": "function", "function": {k: function[k] for k in ("name", "description", "parameters")
                                                     if k in function}})
    return out


# --- answers -------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def logprob_entries(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float], as_ids: bool) -> list[dict]:
    tokens = [f"token_id:{t}" for t in ids] if as_ids else tokenizer.convert_ids_to_tokens(list(ids))
    return [{"token": str(tok), "logprob": lp, "bytes": list(str(tok).encode()), "top_logprobs": []}
            for tok, lp in zip(tokens, logprobs)]


def token_fields(turn: Any, session: str | None) -> dict[str, Any]:
    """The turn's exact tokens, in NeMo-Gym's field names, and where they came from."""
    return {"prompt_token_ids": list(turn.prompt_ids), "generation_token_ids": list(turn.generation_ids),
            "generation_log_probs": list(turn.logprobs), "weight_version": turn.weight_version,
            "session_id": session}


def tool_call_items(calls: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"id": _id("call"), "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def usage(turn: Any) -> dict[str, int]:
    return {"prompt_tokens": len(turn.prompt_ids), "completion_tokens": len(turn.generation_ids),
            "total_tokens": len(turn.prompt_ids) + len(turn.generation_ids)}


def chat_answer(turn: Any, content: str, calls: Sequence[Any], model: str, session: str | None,
                logprobs: list[dict] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = tool_call_items(calls)
    message.update(token_fields(turn, session))
    finish = "tool_calls" if calls else turn.finish_reason
    return {"id": _id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": {"content": logprobs} if logprobs is not None else None,
                         "token_ids": list(turn.generation_ids)}],
            "prompt_token_ids": list(turn.prompt_ids), "usage": usage(turn)}


def completion_answer(turn: Any, model: str, session: str | None, tokenizer: Any,
                      logprobs: list[dict] | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": turn.text, "finish_reason": turn.finish_reason,
                              "token_ids": list(turn.generation_ids), **token_fields(turn, session)}
    choice["logprobs"] = None if logprobs is None else {
        "tokens": [e["token"] for e in logprobs], "token_logprobs": [e["logprob"] for e in logprobs],
        "top_logprobs": None, "text_offset": None}
    return {"id": _id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "prompt_token_ids": list(turn.prompt_ids), "usage": usage(turn)}


def responses_answer(turn: Any, content: str, calls: Sequence[Any], model: str, session: str | None) -> dict:
    output: list[dict[str, Any]] = []
    if content or not calls:
        output.append({"type": "message", "id": _id("msg"), "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for call in calls:
        output.append({"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": call.name,
                       "arguments": json.dumps(call.arguments), "status": "completed"})
    output[-1].update(token_fields(turn, session))  # once per turn: its last item carries the turn's tokens
    counts = usage(turn)
    return {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
            "status": "completed" if turn.finish_reason == "stop" else "incomplete",
            "incomplete_details": None if turn.finish_reason == "stop" else {"reason": "max_output_tokens"},
            "output": output, "usage": {"input_tokens": counts["prompt_tokens"],
                                        "output_tokens": counts["completion_tokens"],
                                        "total_tokens": counts["total_tokens"]}}
