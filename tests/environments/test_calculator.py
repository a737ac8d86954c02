"""The built-in tool-use example (environments/calculator.py, docs/tools.md): prompts, the tiny
model's two-digit calls and the Hermes ones, the process reward, config errors, and the tiny
model learning to use the tool (recipes/tiny-calculator.yaml)."""

from __future__ import annotations

import json
import random
import types
from pathlib import Path

import pytest

from helpers import run_grpoctl
from grpo_sdk.environments.calculator import CalculatorEnvironment, DigitCalls
from grpo_sdk.environments.specs import CalculatorConfig
from grpo_sdk.plugins import Message

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-calculator.yaml"
TINY = CalculatorConfig(tool_parser="digits", reward="reference")


@pytest.fixture(scope="module")
def tokenizer_path_context(tiny_model_dir):
    """What the environment reads of the run's context: where the tokenizer is."""
    return types.SimpleNamespace(tokenizer_path=str(tiny_model_dir))


def episode(tokenizer, prompt: str, *turns: str):
    """The message log after the last of ``turns`` (each "<text>" or "<text>$", $ for <eos>),
    with the tiny format's tool turns between them."""
    log = [Message(role="user", content=prompt)]
    for i, turn in enumerate(turns):
        text = turn.rstrip("$")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if turn.endswith("$")
                                                                          else [])
        log.append(Message(role="assistant", content=text, token_ids=tuple(ids), generation_logprobs=(0.0,) * len(ids)))
        if i < len(turns) - 1:
            log.append(Message(role="tool", content="=?>"))
    return log


def test_prompts_are_sums_of_digits_with_their_target():
    env = CalculatorEnvironment(CalculatorConfig(), None)
    prompts = env.sample_prompts(50, random.Random(0))
    assert prompts == env.sample_prompts(50, random.Random(0))  # every choice from the run's rng
    for text, meta in prompts:
        assert text == "+".join(map(str, meta["operands"])) + ">" and len(meta["operands"]) == 3
        assert meta["target"] == str(sum(meta["operands"]) % 10)
    plain = CalculatorEnvironment(CalculatorConfig(modulus=None, max_operand=99, num_operands=4), None)
    _, meta = plain.sample_prompts(1, random.Random(1))[0]
    assert meta["target"] == str(sum(meta["operands"])) and max(meta["operands"]) <= 99


@pytest.mark.parametrize("text, calls, answer, errors", [
    ("75", [("add", {"x": 7, "y": 5})], None, 0), ("5", [], "5", 0), ("", [], "", 0),
    ("7+", [], None, 1), ("<pad>5", [], None, 1), ("123", [], None, 1)])
def test_the_tiny_models_call_convention(text, calls, answer, errors):
    turn = DigitCalls().parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == calls and len(turn.errors) == errors
    assert turn.is_answer == (answer is not None) and (answer is None or turn.content == answer)


def test_calls_get_results_and_invalid_ones_a_same_length_error(tokenizer_path_context, tokenizer):
    env = CalculatorEnvironment(TINY, tokenizer_path_context)
    logs = [episode(tokenizer, "7+5+3>", "75"), episode(tokenizer, "7+5+3>", "7a"), episode(tokenizer, "7+5+3>", "5$")]
    ret = env.step(logs, [{"operands": [7, 5, 3], "target": "5"}] * 3)
    assert [[m.content for m in o] if o else o for o in ret.observations] == [["=2>"], ["=?>"], None]
    assert ret.done == [False, False, True] and ret.flags == [(), ("invalid_tool_call",), ()]
    assert [len(tokenizer(o[0].content, add_special_tokens=False)["input_ids"]) for o in ret.observations[:2]] == [3, 3]


def test_the_reference_reward_sums_to_one_only_for_the_solution(tokenizer_path_context, tokenizer):
    env = CalculatorEnvironment(TINY, tokenizer_path_context)
    meta = {"operands": [7, 5, 3], "target": "5"}

    def total(*turns):
        return sum(env.step([episode(tokenizer, "7+5+3>", *turns[:k])], [meta]).rewards["calculator"][0]
                   for k in range(1, len(turns) + 1))

    assert total("75", "23", "5$") == pytest.approx(1.0)  # add(7,5)=2, add(2,3)=5, answer 5
    assert total("75", "23", "4$") == pytest.approx(2 / 3 + 1 / 6)  # the answer's digit wrong, its <eos> right
    assert total("75", "33", "5$") == pytest.approx(1 / 3 + 1 / 6 + 1 / 3)  # the second call's first operand wrong
    assert total("5$") == pytest.approx(0.0)  # answered at once: neither 7 nor 5 in place
    assert total("75", "23", "5$", "5$") == pytest.approx(1.0)  # a turn beyond the solution adds nothing


def test_outcome_reward_and_hermes_calls():
    env = CalculatorEnvironment(CalculatorConfig(modulus=None, max_operand=99), None)
    call = '<tool_call>{"name": "add", "arguments": {"x": 37, "y": 45}}</tool_call>'
    logs = [[Message(role="user", content="37+45+12>"), Message(role="assistant", content=call)],
            [Message(role="user", content="37+45+12>"), Message(role="assistant", content="94")],
            [Message(role="user", content="37+45+12>"), Message(role="assistant", content="95")]]
    ret = env.step(logs, [{"operands": [37, 45, 12], "target": "94"}] * 3)
    assert ret.observations[0][0].content == "82" and ret.rewards["calculator"] == [0.0, 1.0, 0.5]
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["add"]


@pytest.mark.parametrize("override, key, message", [
    ("env.calculator.reward=reference", "env.calculator.reward", "needs tool_parser 'digits'"),
    ("env.calculator.modulus=100", "env.calculator.tool_parser", "modulus to at most 10"),
    ("env.calculator.tool_parser=pythonic", "env.calculator.tool_parser", "not a parser"),
])
def test_bad_config_is_exit_2_naming_the_key(tmp_path, override, key, message):
    overrides = [override] + (["env.calculator.tool_parser=digits"] if "modulus" in override else [])
    result = run_grpoctl("config", "validate", "env.name=calculator", *overrides, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert key in result.stderr and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_tiny_model_learns_to_use_the_calculator(tmp_path):
    """The recipe's first 700 of 1500 steps: the reward rises from chance as the model learns to copy
    the operands into its calls; docs/tools.md has the whole curve."""
    result = run_grpoctl("run", "-c", RECIPE, "--run-dir", "run", "grpo.max_num_steps=700", "grpo.val_period=0",
                         cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    first = sum(r["reward/mean"] for r in rows[:50]) / 50
    last = sum(r["reward/mean"] for r in rows[-50:]) / 50
    assert first < 0.15 and last > 0.5, f"reward {first:.3f} -> {last:.3f}"
    assert rows[-1]["episode/turns_mean"] > 2.5 and rows[-1]["env/invalid_call_rate"] < 0.1
