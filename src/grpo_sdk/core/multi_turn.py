"""The multi-turn forms of the Environment protocol (docs/multi-turn.md).

A single-turn environment scores one response. A multi-turn environment answers: after each
assistant turn ``step`` returns that turn's rewards, whether each episode is done, and for the
episodes that go on the messages that continue them (a tool's result, a user's reply). The run
appends those messages to the episode as tokens, once, and samples the next assistant turn from
exactly the tokens so far, up to ``grpo.max_rollout_turns`` turns and
``policy.max_total_sequence_length`` tokens.

A tool-using environment also says which tools it offers (``DeclaresTools``): their JSON schemas
are rendered into the chat template's tools section of every prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from grpo_sdk.core.records import EnvironmentReturn, MessageLog


class MultiTurnEnvironment(Protocol):
    """An environment whose episodes last several turns. Declare the ``multi_turn`` capability.

    ``step`` has the Environment protocol's signature and is called once per turn with the
    episodes still going; each ``message_logs[i]`` ends with the assistant turn just sampled.
    In the ``EnvironmentReturn``:

    * ``rewards``: this turn's rewards. An episode's reward is the sum over its turns; None adds
      nothing. Give a number (0.0) on turns before the answer, so an episode cut short by the
      turn limit still scores (an episode that never scored leaves the loss).
    * ``done``: False continues the episode; True (or None, for every sample) ends it.
    * ``observations``: for an episode that continues, a ``Message`` or a list of them (roles
      ``tool``, ``user``, ...). Their tokens follow the assistant's turn; the loss skips them.
    * ``metadata``: what the sample's next ``step`` gets. Keep the episode's state here, not in
      the environment object: the same sample may be stepped again alone (to name a failing
      sample), and on Ray consecutive turns may reach different actors.
    * ``flags``: what was wrong with the turn (``"invalid_tool_call"``, ``"malformed_thinking"``),
      for ``grpo.invalid_tool_call_advantage`` / ``grpo.malformed_thinking_advantage``.

    Example: guess a number with "higher"/"lower" hints, 1 for the right guess::

        class GuessTheNumber:
            def __init__(self, config, context): ...

            def step(self, message_logs, metadata):
                rewards, done, observations = [], [], []
                for log, meta in zip(message_logs, metadata):
                    guess, secret = log[-1].content.strip(), meta["secret"]
                    rewards.append(1.0 if guess == secret else 0.0)
                    done.append(guess == secret)
                    hint = "higher" if guess.isdigit() and int(guess) < int(secret) else "lower"
                    observations.append(None if guess == secret else Message(role="user", content=hint))
                return EnvironmentReturn(rewards={"correct": rewards}, done=done, observations=observations)
    """

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn: ...


@runtime_checkable
class DeclaresTools(Protocol):
    """An environment that offers tools (declare the ``tool_calls`` capability): every prompt is
    rendered with ``tool_schemas()`` in the chat template's tools section (``tools=`` of
    ``apply_chat_template``), and the environment flags malformed or invalid calls with
    ``"invalid_tool_call"``. ``grpo_sdk.plugins.tools.ToolEnvironment`` implements it.

    Example::

        def tool_schemas(self) -> list[dict]:
            return [{"type": "function", "function": {
                "name": "add", "description": "a + b",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                "b": {"type": "integer"}},
                               "required": ["a", "b"]}}}]
    """

    def tool_schemas(self) -> list[dict[str, Any]]: ...
