"""grpo_sdk.plugins.tools: the Hermes parser, argument checks and the ToolEnvironment base
(docs/tools.md). No model here; tests/environments/test_calculator.py trains one."""

from __future__ import annotations

import sys

import pytest

from grpo_sdk.plugins import ConfigError, EnvironmentReturn, Message
from grpo_sdk.plugins.tools import (INVALID_TOOL_CALL, HermesParser, ParsedTurn, Tool, ToolCall, ToolEnvironment,
                                    argument_problem, tool_call_parser)

ADD = Tool(name="add", description="a + b", function=lambda a, b: a + b,
           parameters={"type": "object", "required": ["a", "b"],
                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize("text, calls, errors, content", [
    ("The answer is 94.", [], 0, "The answer is 94."),
    (call("add", a=1, b=2), [("add", {"a": 1, "b": 2})], 0, ""),
    (f"Let me add.\n{call('add', a=1, b=2)}\n{call('add', a=3, b=4)}", [("add", {"a": 1, "b": 2}),
                                                                        ("add", {"a": 3, "b": 4})], 0, "Let me add."),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', [("add", {"a": 1, "b": 2})],
     0, ""),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', [("add", {"a": 1, "b": 2})], 0, ""),  # stop token ate </tool_call>
    ("<tool_call>{not json}</tool_call>", [], 1, ""),
    ('<tool_call>{"arguments": {}}</tool_call>', [], 1, ""),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', [], 1, ""),
    ('<tool_call>{"name": "add", "arguments": {}} then more', [], 1, ""),  # never closed, text after it
    ("stray </tool_call>", [], 1, "stray"),
])
def test_hermes_parser(text, calls, errors, content):
    turn = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == calls
    assert len(turn.errors) == errors
    if errors == 0:
        assert turn.content == content
    assert turn.is_answer == (not calls and not errors)


@pytest.mark.parametrize("arguments, problem", [
    ({"a": 1, "b": 2}, None),
    ({"a": 1}, "missing argument b"),
    ({"a": 1, "b": 2, "c": 3}, "unknown argument c"),
    ({"a": "1", "b": 2}, "argument a must be integer"),
    ({"a": True, "b": 2}, "argument a must be integer"),  # JSON true is no integer
])
def test_argument_problem(arguments, problem):
    found = argument_problem(ADD, arguments)
    assert (found is None) if problem is None else problem in found


class EchoParser:
    """A parser of another convention: ``CALL name a b``."""

    def parse(self, text):
        if not text.startswith("CALL "):
            return ParsedTurn(content=text)
        name, *args = text.split()[1:]
        return ParsedTurn(content="", calls=(ToolCall(name=name, arguments=dict(zip("ab", map(int, args)))),))


def test_parsers_are_pluggable_by_name_or_module_class(monkeypatch):
    assert isinstance(tool_call_parser("hermes"), HermesParser)
    monkeypatch.setitem(sys.modules, "echo_parsers", sys.modules[__name__])
    assert isinstance(tool_call_parser("echo_parsers:EchoParser"), EchoParser)
    with pytest.raises(ConfigError, match="not a built-in parser"):
        tool_call_parser("pythonic")
    with pytest.raises(ConfigError, match="cannot load the parser 'nowhere:Parser'"):
        tool_call_parser("nowhere:Parser")


class Adder(ToolEnvironment):
    reward_components = ("correct",)

    def tools(self):
        def divide(a: int, b: int) -> float:
            return a / b

        return [ADD, Tool(name="divide", description="a / b", function=divide, parameters=ADD.parameters)]

    def score_answer(self, answer, log, metadata):
        return {"correct": float(answer == str(metadata["target"]))}


class Config:
    tool_parser = "hermes"


def turn(text):
    return [Message(role="user", content="37+45+12"), Message(role="assistant", content=text,
                                                                generation_logprobs=(0.0,))]


def test_tool_environment_answers_calls_and_scores_answers():
    env = Adder(Config(), None)
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["add", "divide"]
    logs = [turn(call("add", a=37, b=45)), turn("94"), turn("93"), turn(call("mul", a=1, b=2)),
            turn(call("divide", a=1, b=0)), turn(call("add", a=1) + call("add", a=2, b=3)), turn("<tool_call>{x")]
    ret = env.step(logs, [{"target": 94}] * len(logs))
    assert isinstance(ret, EnvironmentReturn)
    assert ret.rewards == {"correct": [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]}
    assert ret.done == [False, True, True, False, False, False, False]
    assert [[m.content for m in o] if o else o for o in ret.observations] == [
        ["82"], None, None, ["error: unknown tool 'mul' (tools: add, divide)"],
        ["error: ZeroDivisionError: division by zero"], ["error: add: missing argument b", "5"],
        ["error: the call is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"]]
    assert all(m.role == "tool" for o in ret.observations if o for m in o)
    # a tool that raises is no invalid call; an unknown tool, bad arguments or bad JSON are
    assert [INVALID_TOOL_CALL in f for f in ret.flags] == [False, False, False, True, False, True, True]
    assert ret.metrics["answer_rate"] == pytest.approx(2 / 7)
    assert ret.metrics["invalid_call_rate"] == pytest.approx(3 / 7)
    assert ret.metrics["tool_calls_per_turn"] == pytest.approx(6 / 7)
    assert ret.metrics["tool_error_rate"] == pytest.approx(1 / 6)


def test_a_score_outside_the_declared_components_is_an_error():
    class Wrong(Adder):
        def score_answer(self, answer, log, metadata):
            return {"typo": 1.0}

    with pytest.raises(ValueError, match="scored the component .typo., which is not in its reward_components"):
        Wrong(Config(), None).step([turn("94")], [{"target": 94}])


def test_prompts_render_the_environments_tools_in_the_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    from grpo_sdk.config.schema import DataConfig
    from grpo_sdk.data.prompts import make_builder

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # A tools section of the tool names, from the character vocabulary ("add", "divide" fit a-h).
    tokenizer.chat_template = ("{% if tools %}{% for t in tools %}{{ t['function']['name'] }}={% endfor %}{% endif %}"
                               "{% for m in messages %}{{ m['content'] }}>{% endfor %}")
    builder = make_builder(DataConfig(use_chat_template=True), tokenizer, Adder(Config(), None))
    texts, ids = builder.encode(["12"])
    assert texts == ["add=divide=12>"] and ids[0] == tokenizer("add=divide=12>", add_special_tokens=False)["input_ids"]
    conversations, _ = builder.encode_conversations([[{"role": "user", "content": "12"}]], ["row 0"])
    assert conversations == ["add=divide=12>"]
    assert make_builder(DataConfig(use_chat_template=True), tokenizer, None).encode(["12"])[0] == ["12>"]
