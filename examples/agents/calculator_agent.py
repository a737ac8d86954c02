"""A tool-using agent written with the plain ``openai`` client, trained by grpo-sdk as it is.

The task is the built-in calculator's (docs/tools.md): the prompt is three digits to add,
``7+5+3>``, and the only tool is ``add(x, y)`` modulo 10. The agent below owns its loop: it asks
the model for a turn, reads a two-digit turn as a call (``75`` is ``add(7, 5)``), runs the tool
itself and sends the result back as a ``tool`` message (``=2>``), until the model answers with
one digit. It knows nothing of grpo-sdk beyond the task it is handed: a base URL, a key and the
row. grpo-sdk records what the model sampled at that URL and trains on exactly those tokens.

    python examples/agents/calculator_agent.py tasks.jsonl        # write 20000 tasks
    grpoctl run -c examples/agents/calculator-agent.yaml          # train (docs/agents.md has the curve)

The reward is the calculator's process reward (each turn against the reference solution's turn,
summed; 1.0 only for the exact solution): from the final answer alone the tiny model never finds
the tool (docs/tools.md). The tiny model's tokenizer has no chat template, so the endpoint shows
it the conversation as plain text, the messages' contents one after another.
"""

from __future__ import annotations

import json
import random
import sys

import httpx
from openai import OpenAI

EOS = "<eos>"
# One HTTP client for every rollout: building one (an OpenAI() builds its own) costs ~28 ms of CPU,
# mostly its TLS context, and the harness plays each rollout in a fresh thread.
HTTP = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))


def reference_turns(operands: list[int]) -> list[list[str]]:
    """The solution, turn by turn, as the tiny model's characters: each call's two operands, then
    the answer and the end of the turn."""
    turns, partial = [], operands[0]
    for operand in operands[1:]:
        turns.append(list(f"{partial}{operand}"))
        partial = (partial + operand) % 10
    return turns + [[str(partial), EOS]]


def matching(said: list[str], expected: list[str]) -> float:
    return sum(a == b for a, b in zip(said, expected)) / max(len(said), len(expected), 1)


def run(task) -> float:
    """Play one rollout; the reward."""
    client = OpenAI(base_url=task.base_url, api_key=task.api_key, http_client=HTTP, max_retries=0)
    reference = reference_turns(task.row["operands"])
    messages = [{"role": "user", "content": task.prompt}]
    reward = 0.0
    for k in range(len(reference)):
        reply = client.chat.completions.create(model=task.model, messages=messages, max_tokens=2)
        choice = reply.choices[0]
        text = choice.message.content or ""
        said = list(text) + ([EOS] if choice.finish_reason == "stop" else [])
        reward += matching(said, reference[k]) / len(reference)
        messages.append({"role": "assistant", "content": text})
        if choice.finish_reason == "stop":  # one digit and <eos>: the answer (or nothing: no answer)
            break
        if len(text) == 2 and text.isdigit():  # a call: add(x, y) mod 10, run by the agent itself
            messages.append({"role": "tool", "content": f"={(int(text[0]) + int(text[1])) % 10}>"})
        else:
            messages.append({"role": "tool", "content": "=?>"})
    return reward


def write_tasks(path: str, count: int = 20000, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            operands = [rng.randint(0, 9) for _ in range(3)]
            f.write(json.dumps({"prompt": "+".join(map(str, operands)) + ">", "operands": operands}) + "\n")


if __name__ == "__main__":
    write_tasks(sys.argv[1] if len(sys.argv) > 1 else "tasks.jsonl")
