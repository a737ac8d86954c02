"""Tool-using environments: tools as JSON schemas, calls parsed from the assistant's turn (docs/tools.md).

Public (``grpo_sdk.plugins.tools``), and light: no torch. A tool environment is a multi-turn
environment (``MultiTurnEnvironment``) whose episodes go like this::

    assistant: <tool_call>{"name": "add", "arguments": {"a": 37, "b": 45}}</tool_call>
    tool:      82
    assistant: <tool_call>{"name": "add", "arguments": {"a": 82, "b": 12}}</tool_call>
    tool:      94
    assistant: 94                     <- no call: the answer, scored by ``score_answer``

Every turn with a call is answered with one ``tool`` message per call (the result, or what was
wrong with the call, so the model can recover) and scores ``score_call`` (0 unless a process
reward says otherwise); a turn without a call ends the episode with ``score_answer``'s reward. A malformed call (bad JSON, an unknown tool, arguments
that do not fit the schema) flags the turn ``invalid_tool_call``: counted in
``episode/invalid_tool_call_rate``, and ``grpo.invalid_tool_call_advantage`` can penalise it. A
tool that raises is not an invalid call: its error is the result (counted in ``tool_error_rate``).

Parsers turn an assistant's text into calls. ``hermes`` is built in (Qwen2.5, Qwen3, Hermes 2/3:
JSON objects between ``<tool_call>`` and ``</tool_call>``); any other is a class with
``parse(text) -> ParsedTurn``, named ``"module:Class"`` in an environment's ``tool_parser`` option.

Example, a one-tool environment::

    class Adder(ToolEnvironment):
        def tools(self):
            return [Tool(name="add", description="a + b", function=lambda a, b: a + b,
                         parameters={"type": "object", "required": ["a", "b"],
                                     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})]

        def score_answer(self, answer, log, metadata):
            return {"correct": float(answer.strip() == str(metadata["target"]))}
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any, Callable, Protocol, Sequence

import attrs

from grpo_sdk.core.errors import ConfigError
from grpo_sdk.core.records import EnvironmentReturn, Message

__all__ = ["INVALID_TOOL_CALL", "PARSERS", "HermesParser", "ParsedTurn", "Tool", "ToolCall", "ToolCallParser",
           "ToolEnvironment", "argument_problem", "tool_call_parser"]

INVALID_TOOL_CALL = "invalid_tool_call"


@attrs.frozen(kw_only=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@attrs.frozen(kw_only=True)
class ParsedTurn:
    """An assistant turn read by a parser: its calls, and what was malformed about it."""

    content: str  # the text outside the calls
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()  # one per malformed call: what was wrong

    @property
    def is_answer(self) -> bool:
        """No call, well formed or not: the model answered."""
        return not self.calls and not self.errors


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as many as the turn holds.

    ``arguments`` may also be a JSON string of an object (some models write it so). An open tag
    without its close is malformed, except at the very end of the turn when the close tag was the
    turn's stop token (it is not part of the text)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls, errors, outside, position = [], [], [], 0
        pattern = re.compile(re.escape(self.open_tag) + r"(.*?)(" + re.escape(self.close_tag) + r"|$)", re.DOTALL)
        for match in pattern.finditer(text):
            outside.append(text[position:match.start()])
            position = match.end()
            body, closed = match.group(1), bool(match.group(2))
            call, error = self.read_call(body)
            if not closed and match.end() != len(text):
                error = error or f"{self.open_tag} is never closed with {self.close_tag}"
            if error:
                errors.append(error)
            else:
                calls.append(call)
        outside.append(text[position:])
        rest = "".join(outside)
        if self.close_tag in rest:
            errors.append(f"{self.close_tag} without {self.open_tag}")
        return ParsedTurn(content=rest.replace(self.close_tag, "").strip(), calls=tuple(calls), errors=tuple(errors))

    @staticmethod
    def read_call(body: str) -> tuple[ToolCall | None, str | None]:
        try:
            value = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as exc:
            return None, f"the call is not JSON ({exc})"[:200]
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None, 'the call is not an object with a "name" string'
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                return None, '"arguments" is a string that is not a JSON object'
        if not isinstance(arguments, dict):
            return None, f'"arguments" is {type(arguments).__name__}, not an object'
        return ToolCall(name=value["name"], arguments=arguments), None


PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesParser}


def tool_call_parser(name: str, key: str = "tool_parser") -> ToolCallParser:
    """A built-in parser by name, or ``"module:Class"`` constructed without arguments."""
    if name in PARSERS:
        return PARSERS[name]()
    module, _, attribute = name.partition(":")
    if not module or not attribute:
        raise ConfigError([(key, f"{name!r} is not a built-in parser ({', '.join(sorted(PARSERS))}) or "
                            "'module:Class'")])
    try:
        parser = getattr(importlib.import_module(module), attribute)()
    except (ImportError, AttributeError, TypeError) as exc:
        raise ConfigError([(key, f"cannot load the parser {name!r}: {type(exc).__name__}: {exc}")]) from None
    if not callable(getattr(parser, "parse", None)):
        raise ConfigError([(key, f"{name!r} has no parse(text) method")])
    return parser


@attrs.frozen(kw_only=True)
class Tool:
    """A function the model may call, described by a JSON schema of its (keyword) arguments."""

    name: str
    description: str
    parameters: dict[str, Any]  # {"type": "object", "properties": {...}, "required": [...]}
    function: Callable[..., Any] = attrs.field(eq=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema chat templates render (``tools=`` of apply_chat_template)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def argument_problem(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for ``tool`` (required, unknown and top-level types), or None."""
    properties = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"{tool.name}: missing argument {', '.join(missing)}"
    unknown = [k for k in arguments if k not in properties]
    if unknown:
        return f"{tool.name}: unknown argument {', '.join(unknown)} (it takes {', '.join(properties) or 'none'})"
    for key, value in arguments.items():
        expected = _JSON_TYPES.get(properties[key].get("type", ""), object)
        if not isinstance(value, expected) or (isinstance(value, bool) and expected in (int, (int, float))):
            return f"{tool.name}: argument {key} must be {properties[key].get('type')}, got {json.dumps(value)}"
    return None


class ToolEnvironment:
    """Base of tool-using environments: implement ``tools()`` and ``score_answer``.

    Declare the capabilities ``multi_turn`` and ``tool_calls`` in the spec. ``tool_parser``
    (a config attribute, default ``hermes``) chooses the parser. ``reward_components`` names what
    ``score_answer`` returns (a dict with those keys, or one float for a single component); turns
    that call a tool score 0 on each. Metrics, per turn stepped:
    ``tool_calls_per_turn``, ``invalid_call_rate`` (turns with a malformed call),
    ``tool_error_rate`` (calls whose tool raised) and ``answer_rate`` (turns that answered).
    """

    reward_components: tuple[str, ...] = ("reward",)

    def __init__(self, config: Any, context: Any):
        self.config = config
        self.parser = self.make_parser(getattr(config, "tool_parser", "hermes"))
        self._tools = {tool.name: tool for tool in self.tools()}

    def tools(self) -> Sequence[Tool]:
        raise NotImplementedError

    def score_answer(self, answer: str, log: Sequence[Message], metadata: dict[str, Any]) -> dict[str, float] | float:
        """The reward of an episode's answer (the text of its last turn, calls excluded)."""
        raise NotImplementedError

    def score_call(self, turn: ParsedTurn, log: Sequence[Message], metadata: dict[str, Any]) -> dict[str, float] | float:
        """The reward of a turn that called tools: 0 (the answer decides); a process reward overrides it."""
        return 0.0

    def make_parser(self, name: str) -> ToolCallParser:
        """The parser ``tool_parser`` names (an environment with a convention of its own adds names)."""
        return tool_call_parser(name)

    def format_error(self, problem: str) -> str:
        """What the tool message says of an invalid call."""
        return f"error: {problem}"

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self._tools.values()]

    def format_result(self, call: ToolCall, result: Any) -> str:
        """A tool's result as the tool message's text."""
        return result if isinstance(result, str) else json.dumps(result)

    def call(self, call: ToolCall) -> tuple[str, str | None, bool]:
        """``(result text, what was invalid or None, whether the tool raised)``."""
        tool = self._tools.get(call.name)
        if tool is None:
            problem = f"unknown tool {call.name!r} (tools: {', '.join(self._tools)})"
            return self.format_error(problem), problem, False
        problem = argument_problem(tool, call.arguments)
        if problem is not None:
            return self.format_error(problem), problem, False
        try:
            return self.format_result(call, tool.function(**call.arguments)), None, False
        except Exception as exc:  # noqa: BLE001 - a tool's error is its result, for the model to read
            return f"error: {type(exc).__name__}: {exc}", None, True

    def _record(self, rewards: dict[str, list[float | None]], i: int, score: dict[str, float] | float) -> None:
        for name, value in (score if isinstance(score, dict) else {self.reward_components[0]: score}).items():
            if name not in rewards:
                raise ValueError(f"{type(self).__name__} scored the component {name!r}, which is not in its "
                                 f"reward_components {self.reward_components}")
            rewards[name][i] = value

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        rewards: dict[str, list[float | None]] = {name: [0.0] * len(message_logs) for name in self.reward_components}
        done, observations, flags = [], [], []
        calls = invalid = errors = answers = 0
        for i, (log, meta) in enumerate(zip(message_logs, metadata)):
            turn = self.parser.parse(log[-1].content)
            self._record(rewards, i, self.score_answer(turn.content, log, meta) if turn.is_answer
                         else self.score_call(turn, log, meta))
            if turn.is_answer:
                done.append(True)
                observations.append(None)
                flags.append(())
                answers += 1
                continue
            results, problems = [], list(turn.errors)
            for call in turn.calls:
                text, problem, raised = self.call(call)
                results.append(Message(role="tool", content=text))
                problems += [problem] if problem else []
                errors += raised
            results += [Message(role="tool", content=self.format_error(p)) for p in turn.errors]
            calls += len(turn.calls) + len(turn.errors)
            invalid += bool(problems)
            done.append(False)
            observations.append(results)
            flags.append((INVALID_TOOL_CALL,) if problems else ())
        n = max(len(message_logs), 1)
        return EnvironmentReturn(
            rewards=rewards, done=done, observations=observations,
            flags=flags, metrics={"tool_calls_per_turn": calls / n, "invalid_call_rate": invalid / n,
                                  "tool_error_rate": errors / max(calls, 1), "answer_rate": answers / n})
