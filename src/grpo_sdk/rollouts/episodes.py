"""Episodes: a prompt, then assistant turns and environment turns, carried as token ids.

Token in, token out (docs/multi-turn.md): an assistant turn is kept exactly as it was sampled,
never decoded and encoded again, and an environment turn is tokenised once, when it arrives, as
the chat template continues the conversation. The next turn is generated from those very ids and
the policy is trained on them, so the train sequence is, token for token, what the generation
backend saw: no retokenisation drift between turns.

Per group (the episodes of one prompt), turn by turn, each group at its own pace::

    generate one assistant turn per episode still going   (one request: submit, then poll)
    step the environment on them                         (a call per group, env.max_concurrent_calls
                                                          at once; 0: one call for every group's turn)
    append each observation's tokens; end the episodes that are done, out of turns
    (grpo.max_rollout_turns) or out of room (policy.max_total_sequence_length)

A single-turn environment (``done`` None) ends every episode after its first turn: exactly the
single-turn rollout, token for token.

An episode is truncated when its last assistant turn ended without a stop token (at
``max_new_tokens`` or at the end of the room left), or when the environment's next turn did not
fit; ``grpo.overlong_filtering`` drops truncated episodes from the loss.
"""

from __future__ import annotations

import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Sequence

import attrs
import torch

from grpo_sdk.core.records import GenerationInput, Message, SamplingParams
from grpo_sdk.plugins.tensors import left_pad
from grpo_sdk.rollouts.streaming import Scored, Scorer, as_async, row_seed
from grpo_sdk.serving.continuation import EnvironmentTurns


@attrs.define(kw_only=True, eq=False)
class Episode:
    """One row of a rollout batch while its turns are generated."""

    prompt_ids: list[int]
    log: list[Message]  # the prompt's messages, then every turn
    metadata: dict[str, Any]
    source: str
    chat: bool  # the prompt was rendered by the chat template, so environment turns are too
    tokens: list[int] = attrs.field(factory=list)  # every token after the prompt
    generated: list[bool] = attrs.field(factory=list)  # per token: sampled by the model (the loss's tokens)
    logprobs: list[float] = attrs.field(factory=list)  # per token: generation logprob, 0 on environment tokens
    versions: list[int] = attrs.field(factory=list)  # per token: the weights that sampled it
    rewards: dict[str, float] = attrs.field(factory=dict)  # summed over the turns
    scored: bool = False  # some turn gave a reward
    failure: BaseException | None = None  # the environment failed on it (env.on_reward_error=mask)
    done: bool = False
    truncated: bool = False
    stop_token: int | None = None  # the token that ended the last assistant turn; None: it ran out of tokens
    full: bool = False  # the sequence reached policy.max_total_sequence_length: nothing more can follow
    # (GenerationOutput, row) of the episode's only turn, so the batch takes its tensors as sampled;
    # None once anything follows that turn (the batch is then built from the lists above)
    sampled: tuple[Any, int] | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens


@attrs.define(eq=False)
class _Group:
    """The episodes of one prompt, which go to the generation and the environment together."""

    index: int  # global group index of its first episode (orders the groups)
    episodes: list[Episode]
    rows: list[tuple[int, int]]  # per episode: its global group index and its place in that group (its seeds)
    turn: int = 0
    active: list[Episode] = attrs.field(factory=list)  # this turn's episodes
    room: list[int] = attrs.field(factory=list)  # tokens each has left


@attrs.define(eq=False)
class _Tally:
    """The components the environment named, and its metrics summed weighted by each call's samples."""

    names: set[str] = attrs.field(factory=set)
    sums: dict[str, float] = attrs.field(factory=dict)
    samples: int = 0

    def add(self, result: Scored) -> None:
        self.names.update(result.names)
        for key, value in result.metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * result.samples
        self.samples += result.samples

    def means(self) -> dict[str, float]:
        return {k: v / self.samples for k, v in self.sums.items()}


POLL_S = 0.02  # a streaming poll while environment calls are out: how late a returned call may be seen


def run_episodes(episodes: list[Episode], *, generation: Any, environment: Any, env_name: str, on_error: str,
                 sampling: SamplingParams, max_turns: int, max_total_tokens: int, tokenizer: Any,
                 turns: EnvironmentTurns | None = None, group_size: int | None = None, group_offset: int = 0,
                 seed: int | None = None, max_concurrent_calls: int = 0) -> tuple[list[str], dict[str, float]]:
    """Play every episode to its end; the reward components' names and the environment's metrics
    (each call's, weighted by its samples).

    With ``max_concurrent_calls`` > 0 each group (``group_size`` consecutive episodes; None: all of
    them) is one generation request per turn, scored (``Scorer``) as soon as its request returns, and
    goes on to its next turn as soon as its scoring does; with 0, one request and one call per turn
    cover every episode, as one generate call did. A backend that is not an
    ``AsyncGeneration`` generates only when no call is out, so its batches (and its RNG draws) do not
    depend on timing. ``seed`` (validation: ``SamplingParams.seed``) derives each row's
    ``GenerationInput.seeds`` (``streaming.row_seed``)."""
    size = group_size or max(len(episodes), 1)
    rows = [(group_offset + j // size, j % size) for j in range(len(episodes))]
    engine, streams = as_async(generation, tokenizer.pad_token_id)
    scorer = Scorer(environment, env_name, on_error, max_concurrent_calls)
    # Scored per group, a group is a request of its own; else one request per turn for them all, the
    # batch a generate call had (a backend's numerics depend on its batch: same batches, same runs)
    step = size if scorer.per_group else max(len(episodes), 1)
    groups = [_Group(index=group_offset + start // size, episodes=episodes[start:start + step],
                     rows=rows[start:start + step]) for start in range(0, len(episodes), step)]
    base = sampling.seed if sampling.seed is not None else seed
    prefix = f"rollout-{uuid.uuid4().hex[:8]}-"
    generating: dict[str, _Group] = {}
    scoring: dict[Future, _Group] = {}
    waiting: list[_Group] = []  # generated; scored together once nothing is generating (max_concurrent_calls=0)
    tally = _Tally()
    finished = False

    def submit(group: _Group) -> None:
        request = _next_turn(group, sampling, max_total_tokens, tokenizer.pad_token_id, base)
        if request is not None:
            generating[f"{prefix}{group.index:010d}/{group.turn}"] = group
            engine.submit(f"{prefix}{group.index:010d}/{group.turn}", *request)

    def scored(group: _Group, result: Scored) -> None:
        nonlocal turns
        tally.add(result)
        going = _apply_results(group.active, result.results, last_turn=group.turn == max_turns)
        if going:  # a single-turn rollout never builds the chat continuation
            turns = turns or EnvironmentTurns(tokenizer)
            _append_environment_turns(going, turns, max_total_tokens)
            submit(group)

    # No finish_generation on failure: after a failed call the components' state is the error's (a
    # lost worker refuses every call), and a finish_generation there would hide that error.
    generation.prepare_for_generation()
    try:
        for group in groups:
            submit(group)
        while generating or scoring or waiting:
            if generating and (streams or not scoring):
                returned = []
                for request_id, out in engine.poll(POLL_S if scoring else 1.0):
                    group = generating.pop(request_id)
                    if isinstance(out, BaseException):
                        raise out
                    _take_turn(group.active, group.room, out, tokenizer)
                    returned.append(group)
                # After the last generation a colocated engine sleeps, before scoring as single-turn did
                if not finished and not generating and all(
                        g.turn >= max_turns for g in (*returned, *waiting, *scoring.values())):
                    generation.finish_generation()
                    finished = True
                for group in returned:
                    if scorer.per_group:
                        scoring[scorer.submit([e.log for e in group.active], [e.metadata for e in group.active],
                                              [e.source for e in group.active])] = group
                    else:
                        waiting.append(group)
            if waiting and not generating:  # one call for every episode of the turn, as the batch was
                _score_together(sorted(waiting, key=lambda g: g.index), scorer, scored)
                waiting.clear()
            if scoring:
                done, _ = wait(scoring, timeout=0 if generating and streams else None, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: scoring[f].index):
                    scored(scoring.pop(future), future.result())
    except BaseException:
        engine.cancel(list(generating))
        raise
    finally:
        scorer.close()
    if not finished:
        generation.finish_generation()
    for episode in episodes:
        episode.done = True
    return sorted(tally.names) or ["reward"], tally.means()


def _next_turn(group: _Group, sampling: SamplingParams, max_total_tokens: int, pad_id: int,
               base: int | None) -> tuple[GenerationInput, SamplingParams] | None:
    """The group's next generation request (its episodes still going, each with its room as its
    token budget), or None when every episode has ended."""
    group.turn += 1
    rows = [(row, e) for row, e in zip(group.rows, group.episodes) if not e.done]
    group.active = [e for _, e in rows]
    if not group.active:
        return None
    group.room = [max_total_tokens - len(e.context) for e in group.active]
    limit = min(sampling.max_new_tokens, max(group.room))
    turn_sampling = sampling if limit == sampling.max_new_tokens else attrs.evolve(sampling, max_new_tokens=limit)
    if sampling.seed is not None and group.turn > 1:  # reproducible (validation), yet a fresh draw each turn
        turn_sampling = attrs.evolve(turn_sampling, seed=sampling.seed + group.turn - 1)
    input_ids, attention_mask = left_pad([e.context for e in group.active], pad_id)
    budgets = torch.tensor([min(r, limit) for r in group.room], dtype=torch.long)
    seeds = None if base is None else torch.tensor(
        [row_seed(base, g, i, group.turn) for (g, i), _ in rows], dtype=torch.long)
    return GenerationInput(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=budgets,
                           seeds=seeds), turn_sampling


def _score_together(groups: list[_Group], scorer: Scorer, scored: Any) -> None:
    """One environment call for the episodes of several groups, its answers handed back per group."""
    active = [e for g in groups for e in g.active]
    result = scorer.score([e.log for e in active], [e.metadata for e in active], [e.source for e in active])
    start = 0
    for i, group in enumerate(groups):
        part = result.results[start:start + len(group.active)]
        start += len(group.active)
        # The call's names and metrics once, on its first group, weighted by every sample of the call
        scored(group, attrs.evolve(result, results=part) if i == 0 else Scored(part, [], {}, 0))


def _take_turn(active: list[Episode], room: list[int], out: Any, tokenizer: Any) -> None:
    """Append each episode's sampled turn: its tokens as sampled, cut where the room ends."""
    lengths = out.response_lengths.tolist()
    stopped = (~out.truncated.bool()).tolist()
    tokens, logprobs = out.response_ids.tolist(), out.logprobs.tolist()
    versions = out.token_weight_versions.tolist() if out.token_weight_versions is not None else None
    turns = []
    for i, episode in enumerate(active):
        n = min(lengths[i], room[i])
        ids, turn_logprobs = tokens[i][:n], logprobs[i][:n]
        episode.stop_token = ids[-1] if stopped[i] and n == lengths[i] and ids else None
        episode.truncated = episode.stop_token is None
        episode.full = n >= room[i]
        episode.sampled = (out, i) if not episode.tokens else None
        episode.tokens += ids
        episode.generated += [True] * n
        episode.logprobs += turn_logprobs
        episode.versions += versions[i][:n] if versions is not None else [out.weight_version] * n
        turns.append((ids, turn_logprobs))
    # The stop token ends the turn; it is not the turn's text (an environment sees what the model said).
    texts = tokenizer.batch_decode([ids if e.stop_token is None else ids[:-1] for e, (ids, _) in zip(active, turns)],
                                   skip_special_tokens=False)
    for episode, (ids, turn_logprobs), text in zip(active, turns, texts):
        episode.log.append(Message(role="assistant", content=text, token_ids=tuple(ids),
                                   generation_logprobs=tuple(turn_logprobs)))


def _apply_results(active: list[Episode], results: list[Any], *, last_turn: bool) -> list[tuple[Episode, Any]]:
    """Record each episode's rewards, metadata and flags; end those that are done. The episodes that
    go on, with the messages that continue them."""
    going = []
    for episode, result in zip(active, results):
        if result.failure is not None:
            episode.failure, episode.done = result.failure, True
            continue
        for name, value in result.rewards.items():
            if value is not None:
                episode.rewards[name] = episode.rewards.get(name, 0.0) + value
                episode.scored = True
        if result.metadata is not None:
            episode.metadata = result.metadata
        if result.flags:
            episode.log[-1] = attrs.evolve(episode.log[-1], flags=result.flags)
        if result.done or last_turn or episode.full:
            episode.done = True
        else:
            going.append((episode, result.observation))
    return going


def _append_environment_turns(going: list[tuple[Episode, Any]], turns: EnvironmentTurns,
                              max_total_tokens: int) -> None:
    """Append each observation as tokens (not trained on); an episode it would leave no room in ends
    truncated, the observation unseen."""
    encoded = turns.encode([(messages, e.stop_token, e.chat) for e, messages in going])
    for (episode, messages), ids in zip(going, encoded):
        if len(episode.context) + len(ids) >= max_total_tokens:
            episode.done, episode.truncated = True, True
            continue
        version = episode.versions[-1] if episode.versions else 0
        episode.tokens += ids
        episode.generated += [False] * len(ids)
        episode.logprobs += [0.0] * len(ids)
        episode.versions += [version] * len(ids)
        # The turn's tokens (template text around the messages included) are on its first message.
        for j, message in enumerate(messages):
            episode.log.append(attrs.evolve(message, token_ids=tuple(ids) if j == 0 else (),
                                            generation_logprobs=None, flags=()))
        if not messages and ids:
            episode.log.append(Message(role="environment", content="", token_ids=tuple(ids)))


def response_messages(log: Sequence[Message]) -> list[Message]:
    """The messages after the prompt: the first generated turn and everything after it. Their token
    ids, in order, are the row's response tokens."""
    first = next((i for i, m in enumerate(log) if m.generation_logprobs is not None), len(log))
    return list(log[first:])


def episode_metrics(logs: Sequence[Sequence[Message]]) -> dict[str, float]:
    """Turns and their lengths over a step's episodes; for each flag an environment set, the
    fraction of assistant turns that carry it (``episode/<flag>_rate``)."""
    turns, assistant_tokens, environment_tokens, environment_turns = [], 0, 0, 0
    flagged: dict[str, int] = {}
    for log in logs:
        messages = response_messages(log)
        generated = [m for m in messages if m.generation_logprobs is not None]
        turns.append(len(generated))
        assistant_tokens += sum(len(m.token_ids) for m in generated)
        environment_turns += sum(1 for m in messages if m.generation_logprobs is None and m.token_ids)
        environment_tokens += sum(len(m.token_ids) for m in messages if m.generation_logprobs is None)
        for message in generated:
            for flag in message.flags:
                flagged[flag] = flagged.get(flag, 0) + 1
    total = max(sum(turns), 1)
    out = {"episode/turns_mean": sum(turns) / max(len(turns), 1), "episode/turns_max": float(max(turns, default=0)),
           "episode/assistant_tokens_per_turn": assistant_tokens / total,
           "episode/environment_tokens_per_turn": environment_tokens / max(environment_turns, 1)}
    out.update({f"episode/{flag}_rate": count / total for flag, count in sorted(flagged.items())})
    return out


def flag_malformed_thinking(episodes: Sequence[Episode], open_tag: str, close_tag: str) -> None:
    """Flag ``malformed_thinking`` on every generated turn whose think tags are malformed (the open tag
    written, or the close tag twice: ``algorithms.reward_penalties.malformed_think``)."""
    from grpo_sdk.algorithms.reward_penalties import malformed_think

    for episode in episodes:
        episode.log = [attrs.evolve(m, flags=(*m.flags, "malformed_thinking"))
                       if m.generation_logprobs is not None and "malformed_thinking" not in m.flags
                       and malformed_think(m.content, open_tag, close_tag) else m for m in episode.log]


OVERRIDES = {"invalid_tool_call": "invalid_tool_call_advantage", "malformed_thinking": "malformed_thinking_advantage"}


def override_turn_advantages(advantages: Any, batch: Any, grpo: Any) -> tuple[Any, dict[str, float]]:
    """NeMo-RL's message-level overrides: every token of an assistant turn flagged
    ``invalid_tool_call`` (``malformed_thinking``) gets ``grpo.invalid_tool_call_advantage``
    (``grpo.malformed_thinking_advantage``) in place of the estimator's advantage; a turn with both
    flags takes the first. Applied after advantage clipping, so the configured value is what the
    turn gets (NeMo-RL clipped after, which could cancel a penalty below advantage_clip_low).
    Returns the advantages (a copy when any changed) and NeMo-RL's metrics."""
    values = {flag: getattr(grpo, key) for flag, key in OVERRIDES.items() if getattr(grpo, key) is not None}
    if not values:
        return advantages, {}
    counts = dict.fromkeys(OVERRIDES, 0)
    turns, changed = 0, False
    start = batch.response_start
    for row, log in enumerate(batch.message_logs):
        offset = start
        for message in response_messages(log):
            stop = offset + len(message.token_ids)
            if message.generation_logprobs is not None:
                turns += 1
                flag = next((f for f in values if f in message.flags), None)
                if flag is not None:
                    if not changed:  # an estimator may return a broadcast view: write into a copy
                        advantages, changed = advantages.clone(), True
                    advantages[row, offset:stop] = values[flag]
                    counts[flag] += 1
            offset = stop
    metrics = {"num_assistant_messages": float(turns)}
    for flag, count in counts.items():
        metrics[f"num_{flag}s" if flag == "invalid_tool_call" else f"num_{flag}"] = float(count)
        metrics[f"{flag}_rate"] = count / max(turns, 1)
    return advantages, metrics
