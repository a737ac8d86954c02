"""How an environment's turn continues a conversation, as token ids: computed once per turn.

Shared by the two ways multi-turn episodes are played: the trainer's own turn loop
(``rollouts.episodes``: an ``Environment`` answers each assistant turn) and the rollout endpoint
(``serving.endpoint``: an agent sends the next request of its session). Both append the same
tokens after an assistant turn, so an episode is the same sequence whichever way it was played.
"""

from __future__ import annotations

from typing import Any, Sequence

from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.core.records import Message

_SENTINEL = "\u2063grpo-sdk-assistant-turn\u2063"  # text no real turn holds (an invisible separator around a name)
_BASE = ({"role": "user", "content": "?"},)


class EnvironmentTurns:
    """Token ids of environment turns, each computed once.

    A chat-template episode continues as the template continues a conversation: the text from the
    end of the assistant's turn to the next generation prompt, found by rendering a fixed
    conversation with and without the new messages (the template must be append-only: a message
    added at the end may only add text at the end). A stop token the model sampled that the
    template would also have written (``<|im_end|>``) is not written again. A plain-text episode
    continues with the messages' contents, tokenised without special tokens.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._assistant_tail: str | None = None
        self._closed: str | None = None

    def _render(self, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _chat_text(self, messages: Sequence[Message], stop_token: int | None) -> str:
        if self._closed is None:
            self._closed = self._render([*_BASE, {"role": "assistant", "content": _SENTINEL}], False)
            self._assistant_tail = self._closed[self._closed.index(_SENTINEL) + len(_SENTINEL):]
        try:
            following = self._render([*_BASE, {"role": "assistant", "content": _SENTINEL},
                                      *({"role": m.role, "content": m.content} for m in messages)], True)
        except Exception as exc:  # noqa: BLE001 - Jinja's TemplateError, or whatever the template raises
            roles = ", ".join(repr(m.role) for m in messages)
            raise GrpoSdkError(f"the tokenizer's chat template cannot render the environment's turn (roles {roles}) "
                               f"after an assistant turn: {type(exc).__name__}: {exc}; give the observations a role "
                               "the template knows (often 'user' or 'tool')") from exc
        if not following.startswith(self._closed):
            raise GrpoSdkError(
                f"the tokenizer's chat template ({getattr(self.tokenizer, 'name_or_path', '')!r}) rewrites earlier "
                f"turns when a {messages[0].role if messages else 'new'} message follows the assistant's, so a "
                "multi-turn episode cannot be continued token for token; use a template that only appends "
                "(docs/multi-turn.md), or plain-text prompts (data.use_chat_template=false)")
        tail = self._assistant_tail
        if stop_token is not None:
            stop_text = self.tokenizer.decode([stop_token], skip_special_tokens=False)
            if stop_text and tail.startswith(stop_text):
                tail = tail[len(stop_text):]  # the model wrote the template's end of turn itself
        return tail + following[len(self._closed):]

    def encode(self, turns: Sequence[tuple[Sequence[Message], int | None, bool]]) -> list[list[int]]:
        """Token ids of each ``(messages, the assistant's stop token, chat)`` turn."""
        texts = [self._chat_text(messages, stop) if chat else "".join(m.content for m in messages)
                 for messages, stop, chat in turns]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
