"""The built-in tool-use example: multi-step arithmetic with a two-operand calculator.

The prompt is a sum of ``num_operands`` numbers (``7+5+3>``); the only tool is ``add(x, y)``, and
the answer takes ``num_operands - 1`` calls: ``add(7, 5)``, then that result plus the next
operand, and so on, then the answer. With ``modulus`` (10 in the tiny recipe) the tool and the
answer work modulo it. The tiny built-in model cannot add (addition does not learn from random
init by RL; docs/tools.md), so whatever it gets right beyond chance it gets through the tool.

Two ways to write a call:

* ``tool_parser: hermes`` (the default, for chat models): ``<tool_call>{"name": "add",
  "arguments": {"x": 7, "y": 5}}</tool_call>``; results and errors as plain text.
* ``tool_parser: digits`` (the tiny model's convention; single-digit operands): a turn of exactly
  two digits is a call (``75`` is ``add(7, 5)``), a turn of one digit is the answer. With
  ``policy.generation.max_new_tokens: 2`` a call is a turn that used its two tokens and the
  answer one that stopped at ``<eos>``. Results come back as ``=2>``, an invalid call as ``=?>``
  (the same length, so the episode's layout stays fixed).

Rewards (component ``calculator``):

* ``outcome``: the answer's correct digit positions over the longer of answer and target (as
  ``reverse_digits``); calls score 0.
* ``reference`` (``digits`` only): a process reward. Turn k is compared, token by token, with the
  reference solution's turn k (the two operands of the k-th call; the answer and ``<eos>``), and
  scores its matching positions over the longer length, divided by the number of turns of the
  solution; a turn beyond them scores 0. The sum is 1 only for the exact solution. The tiny model
  never finds the tool from the outcome alone (it answers at once and stays at chance), so the
  built-in recipe rewards the process; docs/tools.md has the measurements.
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

from grpo_sdk.environments.reverse_digits import correct_positions
from grpo_sdk.environments.specs import CalculatorConfig
from grpo_sdk.plugins import Message
from grpo_sdk.plugins.tools import ParsedTurn, Tool, ToolCall, ToolCallParser, ToolEnvironment
from grpo_sdk.plugins.toolkit import load_tokenizer

_TWO_DIGITS = re.compile(r"^(\d)(\d)$")
_ONE_DIGIT = re.compile(r"^\d$")


class DigitCalls:
    """The tiny model's calls: two digits are ``add(first, second)``, one digit is the answer,
    anything else a malformed call."""

    def parse(self, text: str) -> ParsedTurn:
        call = _TWO_DIGITS.match(text)
        if call:
            return ParsedTurn(content="", calls=(ToolCall(name="add", arguments={"x": int(call[1]), "y": int(call[2])}),))
        if _ONE_DIGIT.match(text) or text == "":
            return ParsedTurn(content=text)
        return ParsedTurn(content="", errors=(f"{text!r} is neither a call (two digits) nor an answer (one digit)",))


class CalculatorEnvironment(ToolEnvironment):
    """Example::

        env = CalculatorEnvironment(CalculatorConfig(), context=None)
        env.sample_prompts(1, random.Random(0))   # [("6+6+0>", {"operands": [6, 6, 0], "target": "2"})]
    """

    reward_components = ("calculator",)

    def __init__(self, config: CalculatorConfig | None, context: Any):
        self.config = config = config or CalculatorConfig()
        super().__init__(config, context)
        self.context = context
        self._tokenizer: Any = None  # the run's: what a turn should be, token by token (reward reference)

    def tools(self) -> list[Tool]:
        modulus = self.config.modulus
        return [Tool(name="add", description="Add two integers" + (f" modulo {modulus}" if modulus else "") + ".",
                     function=lambda x, y: (x + y) % modulus if modulus else x + y,
                     parameters={"type": "object", "required": ["x", "y"],
                                 "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}})]

    def make_parser(self, name: str) -> ToolCallParser:
        return DigitCalls() if name == "digits" else super().make_parser(name)

    def format_result(self, call: ToolCall, result: Any) -> str:
        return f"={result}>" if self.config.tool_parser == "digits" else str(result)

    def format_error(self, problem: str) -> str:
        return "=?>" if self.config.tool_parser == "digits" else super().format_error(problem)

    def sample_prompts(self, num_prompts: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        c = self.config
        top = c.modulus - 1 if c.modulus else c.max_operand
        prompts = []
        for _ in range(num_prompts):
            operands = [rng.randint(0, top) for _ in range(c.num_operands)]
            prompts.append(("+".join(map(str, operands)) + ">",
                            {"operands": operands, "target": str(self._total(operands))}))
        return prompts

    def _total(self, operands: Sequence[int]) -> int:
        return sum(operands) % self.config.modulus if self.config.modulus else sum(operands)

    def _reference_turns(self, operands: Sequence[int]) -> list[list[int]]:
        """The token ids of the solution's turns: each call's two operands, then the answer and <eos>."""
        if self._tokenizer is None:  # on first use: building the environment (config validate) needs no torch
            self._tokenizer = load_tokenizer(self.context.tokenizer_path)
        tokenizer = self._tokenizer

        def ids(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        turns, partial = [], operands[0]
        for operand in operands[1:]:
            turns.append(ids(f"{partial}{operand}"))
            partial = self._total([partial, operand])
        return turns + [ids(str(partial)) + [tokenizer.eos_token_id]]

    def _turn_reward(self, log: Sequence[Message], metadata: dict[str, Any]) -> float:
        reference = self._reference_turns(metadata["operands"])
        k = sum(m.generation_logprobs is not None for m in log)  # this turn's number, from 1
        return correct_positions(list(log[-1].token_ids), reference[k - 1]) / len(reference) \
            if k <= len(reference) else 0.0

    def score_call(self, turn: ParsedTurn, log: Sequence[Message], metadata: dict[str, Any]) -> float:
        return self._turn_reward(log, metadata) if self.config.reward == "reference" else 0.0

    def score_answer(self, answer: str, log: Sequence[Message], metadata: dict[str, Any]) -> float:
        if self.config.reward == "reference":
            return self._turn_reward(log, metadata)
        return correct_positions(answer.strip(), metadata["target"])
