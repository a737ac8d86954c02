"""NeMo-RL's reward-zeroing penalties (``reward_penalties.*``), over the generated messages of any environment.

NeMo-RL applies them inside its NeMo-Gym rollout, to Gym's Responses-API items; here they read
what every environment's episode has: the messages the policy generated (``generation_logprobs``
set), their text and their token ids, so single- and multi-turn episodes are treated alike. A
flagged sample's reward and every reward component become 0, before scaling and shaping
(docs/algorithms.md, Reward penalties). Semantics follow ``apply_reward_penalties`` in
NVIDIA-NeMo/RL ``nemo_rl/experience/rollouts.py``; where Gym's items have no counterpart the
rule is ours and says so.

The think-tag helpers are pure and public: ``malformed_think`` (text) and ``malformed_think_ids``
(token ids) also back ``grpo.malformed_thinking_advantage``, one message at a time.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from grpo_sdk.config.schema import RewardPenaltyConfig

# Upstream's rollout-metric names, so a NeMo-RL user's dashboards line up: the fraction of the
# samples each penalty flagged (flagged, not "changed": a sample already at 0 counts too).
RATE_METRICS = {
    "duplicated_reasoning": "reasoning_equal_to_final_answer_rate",
    "empty_final_answer": "empty_final_answer_rate",
    "unwanted_token": "unwanted_token_rate",
    "malformed_think_tag": "malformed_think_tag_rate",
}
FLAGS = {
    "duplicated_reasoning": "penalize_duplicated_reasoning",
    "empty_final_answer": "penalize_empty_final_answer",
    "unwanted_token": "penalize_unwanted_tokens",
    "malformed_think_tag": "penalize_malformed_think_tag",
}


# --- think tags, one message at a time ------------------------------------------------------------


def malformed_think(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> bool:
    """Upstream's string check: a generated text may not contain the open tag (templates put it in the
    prompt; a model spelling it out, even piecemeal, is malformed) nor the close tag twice."""
    return open_tag in text or text.count(close_tag) > 1


def thinking_mode(context_ids: Sequence[int], open_id: int, close_id: int) -> bool | None:
    """Whether the tokens before a generated message leave a think block open: the open tag once more
    than the close tag (Qwen3's enable_thinking=True ends the prompt with ``<think>``) is True, as many
    (no tags, or enable_thinking=False's empty block) is False, anything else None (malformed prompt)."""
    delta = sum(1 for t in context_ids if t == open_id) - sum(1 for t in context_ids if t == close_id)
    return {0: False, 1: True}.get(delta)


def malformed_think_ids(generated_ids: Sequence[int], open_id: int, close_id: int, thinking: bool | None) -> bool:
    """Upstream's token-id check: with thinking on, exactly one close tag and no open tag; off, neither;
    an unexpected prompt pattern (``thinking`` None) is malformed."""
    if thinking is None:
        return True
    opens = sum(1 for t in generated_ids if t == open_id)
    closes = sum(1 for t in generated_ids if t == close_id)
    return opens != 0 or closes != int(thinking)


def split_think(text: str, open_tag: str = "<think>", close_tag: str = "</think>",
                thinking: bool | None = None) -> tuple[str, str]:
    """``(reasoning, answer)`` of one generated text, as a reasoning parser splits it (ours where the
    text alone is ambiguous).

    With the close tag: the text before its first occurrence (less a leading open tag) and the text
    after it. Without it: all reasoning if the text opened a block or ``thinking`` says the prompt did
    (the model ran out of tokens mid-thought: no answer), else all answer (no think block).
    """
    head, found, tail = text.partition(close_tag)
    if found:
        stripped = head.lstrip()
        return (stripped[len(open_tag):] if stripped.startswith(open_tag) else head), tail
    if open_tag in text:
        return text.split(open_tag, 1)[1], ""
    return (text, "") if thinking else ("", text)


# --- the generated messages of a sample -----------------------------------------------------------


@attrs.frozen
class ThinkTags:
    """The tags as text, and their token ids when known (configured, or each tag one token)."""

    open: str
    close: str
    open_id: int | None = None
    close_id: int | None = None


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def resolve_think_tags(cfg: RewardPenaltyConfig, tokenizer: Any = None) -> ThinkTags:
    """``reward_penalties.thinking_tags`` with their ids: ``token_ids.think_open/close`` when set
    (config checks require both or neither), else the tokenizer's, when each tag is one token."""
    open_tag, close_tag = cfg.thinking_tags
    open_id, close_id = cfg.token_ids.think_open, cfg.token_ids.think_close
    if open_id is None and close_id is None and tokenizer is not None:
        open_id, close_id = _single_token(tokenizer, open_tag), _single_token(tokenizer, close_tag)
        if open_id is None or close_id is None:  # a multi-token tag: the id check is skipped, as upstream
            open_id = close_id = None
    return ThinkTags(open_tag, close_tag, open_id, close_id)


@attrs.frozen
class Turn:
    """One generated message, and the thinking mode its context set (None: ids unknown or malformed)."""

    text: str
    token_ids: tuple[int, ...]
    thinking: bool | None
    flags: tuple[str, ...]


def generated_turns(log: Sequence[Any], tags: ThinkTags, prompt_ids: Sequence[int] | None = None) -> list[Turn]:
    """The messages of ``log`` the policy generated (``generation_logprobs`` set), in order.

    The thinking mode of each is read from every token before it: ``prompt_ids`` (what the model saw)
    stand for the messages before the first generated one when given, since a conversational
    prompt's messages carry no token ids; later turns add the token ids of the messages in between.
    """
    turns, context, started = [], list(prompt_ids or ()), False
    for message in log:
        if message.generation_logprobs is None:
            if started or prompt_ids is None:
                context.extend(message.token_ids)
            continue
        started = True
        thinking = None
        if tags.open_id is not None and tags.close_id is not None:
            thinking = thinking_mode(context, tags.open_id, tags.close_id)
        turns.append(Turn(message.content, tuple(message.token_ids), thinking, tuple(getattr(message, "flags", ()))))
        context.extend(message.token_ids)
    return turns


def reasoning_and_answer(turns: Sequence[Turn], tags: ThinkTags) -> tuple[str, str]:
    """A sample's reasoning and answer texts, each concatenated over its generated messages."""
    parts = [split_think(t.text, tags.open, tags.close, t.thinking) for t in turns]
    return "".join(r for r, _ in parts), "".join(a for _, a in parts)


# --- the four penalties ------------------------------------------------------------------------


def duplicated_reasoning(turns: Sequence[Turn], tags: ThinkTags) -> bool:
    """A generated message repeats its reasoning as its answer verbatim (stripped, both non-empty)."""
    for turn in turns:
        reasoning, answer = split_think(turn.text, tags.open, tags.close, turn.thinking)
        if reasoning.strip() and reasoning.strip() == answer.strip():
            return True
    return False


def empty_final_answer(turns: Sequence[Turn], tags: ThinkTags) -> bool:
    """No generated message, or nothing but whitespace after the last one's think block. A final turn
    that is a tool call is not empty: its text holds the call (upstream skips a trailing function_call)."""
    if not turns:
        return True
    last = turns[-1]
    return not split_think(last.text, tags.open, tags.close, last.thinking)[1].strip()


def unwanted_token(turns: Sequence[Turn], unwanted: Sequence[int]) -> bool:
    """Any generated token, the last one included, is one of ``unwanted``."""
    banned = set(unwanted)
    return any(t in banned for turn in turns for t in turn.token_ids)


def malformed_think_tag(turns: Sequence[Turn], tags: ThinkTags) -> bool:
    """Any generated message the environment flagged ``malformed_thinking``, or that fails the token-id
    check (tag ids known) or the string check."""
    for turn in turns:
        if "malformed_thinking" in turn.flags or malformed_think(turn.text, tags.open, tags.close):
            return True
        if tags.open_id is not None and tags.close_id is not None and \
                malformed_think_ids(turn.token_ids, tags.open_id, tags.close_id, turn.thinking):
            return True
    return False


def penalty_flags(cfg: RewardPenaltyConfig, tags: ThinkTags,
                  samples: Sequence[Sequence[Turn]]) -> dict[str, torch.Tensor]:
    """``name -> [B] bool`` for each enabled penalty (names as ``RATE_METRICS``)."""
    checks = {
        "duplicated_reasoning": lambda turns: duplicated_reasoning(turns, tags),
        "empty_final_answer": lambda turns: empty_final_answer(turns, tags),
        "unwanted_token": lambda turns: unwanted_token(turns, cfg.token_ids.unwanted or ()),
        "malformed_think_tag": lambda turns: malformed_think_tag(turns, tags),
    }
    return {name: torch.tensor([check(turns) for turns in samples], dtype=torch.bool)
            for name, check in checks.items() if getattr(cfg, FLAGS[name])}


def any_penalty(cfg: RewardPenaltyConfig) -> bool:
    return any(getattr(cfg, flag) for flag in FLAGS.values())


def apply_penalties(components: dict[str, torch.Tensor], flags: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Every component 0 where any penalty flagged the sample; the rate metrics, and
    ``reward_penalties/zeroed_fraction``: the samples a penalty took a non-zero reward from."""
    size = next(iter(components.values())).numel()
    hit = torch.zeros(size, dtype=torch.bool)
    for flagged in flags.values():
        hit |= flagged
    before = torch.stack(list(components.values())).sum(0)
    out = {name: torch.where(hit, torch.zeros_like(value), value) for name, value in components.items()}
    metrics = {RATE_METRICS[name]: float(flagged.float().mean()) if size else 0.0 for name, flagged in flags.items()}
    metrics["reward_penalties/zeroed_fraction"] = float((hit & (before != 0)).float().mean()) if size else 0.0
    return out, metrics
