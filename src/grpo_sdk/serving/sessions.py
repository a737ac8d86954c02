"""What the rollout endpoint sampled, turn by turn, per session: the tokens training uses.

An agent talks to the endpoint in text (OpenAI messages), and text is lossy: re-tokenising an
assistant turn can give other ids than were sampled (``" 12"`` sampled as two tokens, encoded as
one), and a chat template may rewrite old turns (drop the thinking). So the endpoint never trusts
the text of a turn it produced. It records every turn's exact ids (``Turn``), and when the next
request of a session arrives (its history holds one more assistant message, then new messages)
the new prompt is the last turn's prompt + generation followed by the new messages as the chat
template continues a conversation: the continuation multi-turn environments get
(``rollouts.episodes.EnvironmentTurns``). The training sequence of a session is then one chain of
turns, each prompt extending the last turn's context, and the trainer builds the episode from
these ids, never from re-tokenised text (``SessionLog.chain``). What the agent did to its copy of
the history (stripped the thinking, reformatted a tool call) does not change what is trained.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import attrs


@attrs.frozen(kw_only=True)
class Turn:
    """One generation the endpoint served: exactly what the model saw and sampled."""

    prompt_ids: tuple[int, ...]
    generation_ids: tuple[int, ...]  # the stop token included when one was sampled
    logprobs: tuple[float, ...]  # of each generated token, under the distribution it was sampled from
    versions: tuple[int, ...]  # the weights that sampled each generated token
    finish_reason: str  # "stop" (a stop token or stop string) or "length"
    text: str = ""  # the generated text as answered (tool calls included, stop token excluded)
    flags: tuple[str, ...] = ()  # "invalid_tool_call", "malformed_thinking": set by the endpoint's parser
    assistant_messages: int = 0  # assistant messages in the request's history (a continuation has one more)
    stop_token: int | None = None  # the stop token that ended it (its last id); None: max tokens or a stop string

    @property
    def context(self) -> tuple[int, ...]:
        return self.prompt_ids + self.generation_ids

    @property
    def weight_version(self) -> int:
        return min(self.versions) if self.versions else 0


class SessionLog:
    """Every session's turns, thread-safe; sessions the trainer never collects expire after ``ttl_s``."""

    def __init__(self, ttl_s: float = 3600.0, max_sessions: int = 100_000):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._turns: dict[str, list[Turn]] = {}
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()

    def last(self, session: str) -> Turn | None:
        with self._lock:
            turns = self._turns.get(session)
            return turns[-1] if turns else None

    def record(self, session: str, turn: Turn) -> None:
        now = time.monotonic()
        with self._lock:
            self._turns.setdefault(session, []).append(turn)
            self._touched[session] = now
            if len(self._turns) > self.max_sessions or len(self._turns) % 1024 == 0:
                self._expire(now)

    def turns(self, session: str) -> list[Turn]:
        with self._lock:
            return list(self._turns.get(session, ()))

    def take(self, session: str) -> list[Turn]:
        """The session's turns, forgetting them (the trainer collects each session once)."""
        with self._lock:
            self._touched.pop(session, None)
            return self._turns.pop(session, [])

    def __len__(self) -> int:
        with self._lock:
            return len(self._turns)

    def _expire(self, now: float) -> None:
        old = [s for s, t in self._touched.items() if now - t > self.ttl_s]
        old += sorted(self._touched, key=self._touched.get)[:max(0, len(self._turns) - len(old) - self.max_sessions)]
        for session in old:
            self._turns.pop(session, None)
            self._touched.pop(session, None)

    @staticmethod
    def chain(turns: Sequence[Turn]) -> tuple[list[Turn], str | None]:
        """The turns as one training sequence: each prompt must extend the previous turn's context.
        Returns the turns and None, or the turns up to the first break and why it broke (an agent
        that edits its history, forks or summarises cannot be trained as one sequence)."""
        for i in range(1, len(turns)):
            context = turns[i - 1].context
            if turns[i].prompt_ids[:len(context)] != context:
                return list(turns[:i]), (f"turn {i + 1}'s prompt does not extend turn {i}'s prompt and generation "
                                         "(the agent changed its history, or ran two conversations in one session)")
        return list(turns), None
