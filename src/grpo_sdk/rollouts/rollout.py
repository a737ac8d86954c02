"""Rollouts: tokenize prompts, play G episodes each (``rollouts.episodes``), build the batch.

Decoding and the loss mask stop at the same place, the first stop token or ``max_new_tokens``
(a prototype that decoded up to ``<pad>`` but masked up to ``<eos>`` taught the policy to emit
``<pad>`` as a terminator). Any other special token inside a response is decoded as text, so
the environment sees it and scores it as wrong.

The message log an environment gets: ``[user, assistant]`` for a plain prompt (the user message
holds the prompt as the model saw it, templates applied, and its token ids); for a
conversational row the row's own messages (raw content, no token ids: the chat template rendered
them together) followed by the assistant message. The assistant message holds the response's
token ids and generation logprobs either way. A multi-turn episode goes on with the environment's
messages (their token ids on the first one of each turn) and the next assistant turns.

The response of a row is everything after its prompt: the assistant turns and, multi-turn, the
environment turns between them; ``generated_mask`` tells the sampled tokens (the loss's) apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import attrs
import torch

from grpo_sdk.core.agents import RunsAgents
from grpo_sdk.core.errors import DataError
from grpo_sdk.core.records import Message, SamplingParams, TrainBatch
from grpo_sdk.data.prompts import Prompt, PromptBuilder
from grpo_sdk.plugins.tensors import left_pad
from grpo_sdk.rollouts.environment_step import prompt_message
from grpo_sdk.rollouts.episodes import Episode, episode_metrics, flag_malformed_thinking, run_episodes

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig


def tokenize_prompts(tokenizer: Any, prompts: Sequence[Prompt], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each prompt: as tokenized when the dataset was loaded, else tokenized now (a
    conversational prompt rendered by the chat template first, as ``load_prompts`` does)."""
    fresh = [p for p in prompts if getattr(p, "token_ids", None) is None]
    plain = [p.text for p in fresh if getattr(p, "messages", None) is None]
    chats = [p for p in fresh if getattr(p, "messages", None) is not None]
    encoded = iter(tokenizer(plain, add_special_tokens=True)["input_ids"] if plain else [])
    rendered = iter(PromptBuilder(tokenizer=tokenizer).encode_conversations(
        [p.messages for p in chats], [p.source for p in chats])[1] if chats else [])
    ids = [list(p.token_ids) if getattr(p, "token_ids", None) is not None
           else next(rendered) if getattr(p, "messages", None) is not None else next(encoded) for p in prompts]
    for prompt, row in zip(prompts, ids):
        if len(row) > max_prompt_tokens:
            raise DataError(f"{prompt.source}: prompt is {len(row)} tokens, longer than the {max_prompt_tokens} "
                            "allowed (data.max_input_seq_length, or policy.max_total_sequence_length - "
                            "policy.generation.max_new_tokens)")
    return ids


def prompt_log(prompt: Prompt, prompt_ids: Sequence[int]) -> list[Message]:
    """The messages before the response: the row's own for a conversational prompt, else one user message."""
    if prompt.messages is not None:
        return [Message(role=m["role"], content=m["content"]) for m in prompt.messages]
    return [Message(role="user", content=prompt.text, token_ids=tuple(prompt_ids))]


@attrs.define(kw_only=True, eq=False)
class RolloutBatch:
    """Scored rollouts, before they become a TrainBatch.

    Prompts stay left-padded and responses right-padded in separate tensors, so batches from
    several generation rounds (dynamic sampling) can be filtered by row and concatenated.
    """

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, R] right-padded: every token after the prompt
    response_lengths: torch.Tensor  # [B]
    generation_logprobs: torch.Tensor  # [B, R], 0 on environment tokens
    truncated: torch.Tensor  # [B] bool
    group_ids: torch.Tensor  # [B]
    reward_components: dict[str, torch.Tensor]  # name -> [B], as the environment returned them
    reward_valid: torch.Tensor  # [B] bool: False where the environment failed (on_reward_error=mask) or gave no reward
    reward_missing: torch.Tensor  # [B] bool: True where the environment gave no reward (every component None)
    message_logs: list[list[Message]]
    metadata: list[dict[str, Any]]
    pad_token_id: int
    weight_version: int = 0  # the oldest weights any token came from
    token_weight_versions: torch.Tensor | None = None  # [B, R] long, after an in-flight update; None: all weight_version
    rewards: torch.Tensor | None = None  # [B] total after scaling and shaping
    unshaped_rewards: torch.Tensor | None = None  # [B] total after scaling, before shaping
    # [B, R] bool: the tokens the model sampled (multi-turn: not the environment's); None: the whole response
    generated_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def sampled(self) -> torch.Tensor:
        """``[B, R]`` bool: True on the tokens the model sampled."""
        response = torch.arange(self.response_ids.shape[1])[None, :] < self.response_lengths[:, None]
        return response if self.generated_mask is None else response & self.generated_mask

    @property
    def generated_lengths(self) -> torch.Tensor:
        """``[B]``: tokens the model sampled per row (the response length of a single-turn row)."""
        return self.response_lengths if self.generated_mask is None else self.sampled.sum(1)

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """The rows ``index`` (a bool mask or positions), in order."""
        rows = index.nonzero().flatten().tolist() if index.dtype == torch.bool else index.tolist()
        tensors = {f.name: getattr(self, f.name)[index] for f in attrs.fields(RolloutBatch)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return attrs.evolve(self, **tensors, reward_components={k: v[index] for k, v in self.reward_components.items()},
                            message_logs=[self.message_logs[i] for i in rows], metadata=[self.metadata[i] for i in rows])

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Rows of several batches; prompts re-padded on the left, responses on the right."""
        first = batches[0]
        prompt_width = max(b.prompt_ids.shape[1] for b in batches)
        response_width = max(b.response_ids.shape[1] for b in batches)

        def pad(name: str, width: int, left: bool, value: float) -> torch.Tensor:
            parts = []
            for b in batches:
                t = getattr(b, name)
                missing = width - t.shape[1]
                parts.append(torch.nn.functional.pad(t, (missing, 0) if left else (0, missing), value=value))
            return torch.cat(parts)

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(b, name) for b in batches]
            return None if any(v is None for v in values) else torch.cat(values)

        generated = None
        if any(b.generated_mask is not None for b in batches):
            generated = torch.cat([torch.nn.functional.pad(b.sampled, (0, response_width - b.response_ids.shape[1]),
                                                           value=False) for b in batches])
        versions = None
        if any(b.token_weight_versions is not None for b in batches):
            versions = torch.cat([torch.nn.functional.pad(
                b.token_weight_versions if b.token_weight_versions is not None
                else torch.full(b.response_ids.shape, b.weight_version, dtype=torch.long),
                (0, response_width - b.response_ids.shape[1]), value=b.weight_version) for b in batches])
        return RolloutBatch(
            token_weight_versions=versions, generated_mask=generated,
            prompt_ids=pad("prompt_ids", prompt_width, True, first.pad_token_id),
            prompt_mask=pad("prompt_mask", prompt_width, True, 0),
            response_ids=pad("response_ids", response_width, False, first.pad_token_id),
            response_lengths=cat("response_lengths"),
            generation_logprobs=pad("generation_logprobs", response_width, False, 0.0),
            truncated=cat("truncated"), group_ids=cat("group_ids"),
            reward_components={k: torch.cat([b.reward_components[k] for b in batches]) for k in first.reward_components},
            reward_valid=cat("reward_valid"), reward_missing=cat("reward_missing"),
            message_logs=[log for b in batches for log in b.message_logs],
            metadata=[m for b in batches for m in b.metadata],
            pad_token_id=first.pad_token_id, weight_version=min(b.weight_version for b in batches),
            rewards=cat("rewards"), unshaped_rewards=cat("unshaped_rewards"),
        )

    def to_train_batch(self, sample_mask: torch.Tensor) -> TrainBatch:
        width = self.response_ids.shape[1]
        response_mask = (torch.arange(width)[None, :] < self.response_lengths[:, None]).long()
        return TrainBatch(
            input_ids=torch.cat([self.prompt_ids, self.response_ids], dim=1),
            attention_mask=torch.cat([self.prompt_mask, response_mask], dim=1),
            token_mask=torch.cat([torch.zeros_like(self.prompt_ids), self.sampled.long()], dim=1).float(),
            sample_mask=sample_mask,
            generation_logprobs=torch.cat([torch.zeros(self.prompt_ids.shape), self.generation_logprobs], dim=1),
            group_ids=self.group_ids,
            rewards=self.rewards,
            extras={f"reward/{name}": value for name, value in self.reward_components.items()},
            reward_components=dict(self.reward_components), reward_valid=self.reward_valid, truncated=self.truncated,
            response_start=int(self.prompt_ids.shape[1]), message_logs=self.message_logs, metadata=self.metadata,
        )


def collect_rollouts(*, prompts: list[Prompt], tokenizer: Any, generation: Any, environment: Any, cfg: MasterConfig,
                     sampling: SamplingParams, max_prompt_tokens: int, group_offset: int,
                     num_generations: int | None = None) -> tuple[RolloutBatch, dict[str, float]]:
    """Play ``num_generations`` (default ``grpo.num_generations_per_prompt``) episodes per prompt,
    up to ``grpo.max_rollout_turns`` turns each, and score them."""
    G = num_generations or cfg.grpo.num_generations_per_prompt
    prompt_ids = tokenize_prompts(tokenizer, prompts, max_prompt_tokens)
    chat = cfg.data.use_chat_template
    episodes = [Episode(prompt_ids=ids, log=prompt_log(prompt, ids), metadata=dict(prompt.metadata),
                        source=prompt.source, chat=chat or prompt.messages is not None)
                for prompt, ids in zip(prompts, prompt_ids) for _ in range(G)]
    if isinstance(environment, RunsAgents):  # the agents play the turns over the rollout endpoint
        from grpo_sdk.rollouts.agent_rollouts import play_agents

        names, env_metrics = play_agents(
            episodes, [p for p in prompts for _ in range(G)], environment=environment, generation=generation,
            tokenizer=tokenizer, sampling=sampling, max_total_tokens=cfg.policy.max_total_sequence_length,
            on_error=cfg.env.on_reward_error, env_name=cfg.env.name, group_offset=group_offset, group_size=G)
    else:
        names, env_metrics = run_episodes(
            episodes, generation=generation, environment=environment, env_name=cfg.env.name,
            on_error=cfg.env.on_reward_error, sampling=sampling, max_turns=cfg.grpo.max_rollout_turns,
            max_total_tokens=cfg.policy.max_total_sequence_length, tokenizer=tokenizer, group_size=G,
            group_offset=group_offset, seed=cfg.grpo.seed, max_concurrent_calls=cfg.env.max_concurrent_calls)
    if cfg.grpo.malformed_thinking_advantage is not None:  # NeMo-RL's NeMo-Gym flagged these; any episode here
        flag_malformed_thinking(episodes, *cfg.reward_penalties.thinking_tags)
    batch = batch_of(episodes, names, tokenizer.pad_token_id,
                     torch.arange(group_offset, group_offset + len(prompts)).repeat_interleave(G))
    return batch, {f"env/{k}": float(v) for k, v in env_metrics.items()}


def batch_of(episodes: list[Episode], names: list[str], pad_token_id: int, group_ids: torch.Tensor) -> RolloutBatch:
    """The finished episodes as one batch: prompts left-padded, everything after them right-padded.
    Single-turn, the response tensors are the generation's own rows (``sampled_responses``)."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_token_id)
    responses = sampled_responses(episodes, pad_token_id)
    if responses is None:
        responses = listed_responses(episodes, pad_token_id)
    response_ids, lengths, logprobs, versions, generated = responses
    oldest = int(versions[generated].min()) if bool(generated.any()) else 0
    after = torch.arange(response_ids.shape[1])[None, :] >= lengths[:, None]
    versions = torch.where(after, oldest, versions)  # past the response: the oldest, as if sampled by it
    failed = torch.tensor([e.failure is not None for e in episodes], dtype=torch.bool)
    missing = torch.tensor([e.failure is None and not e.scored for e in episodes], dtype=torch.bool)
    single_turn = all(all(e.generated) for e in episodes)
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_lengths=lengths,
        generation_logprobs=logprobs,
        truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool), group_ids=group_ids,
        reward_components={n: torch.tensor([e.rewards.get(n, 0.0) if e.failure is None else 0.0 for e in episodes],
                                           dtype=torch.float32) for n in names},
        reward_valid=~failed & ~missing, reward_missing=missing,
        message_logs=[e.log for e in episodes], metadata=[e.metadata for e in episodes], pad_token_id=pad_token_id,
        weight_version=oldest, token_weight_versions=None if bool((versions == oldest).all()) else versions,
        generated_mask=None if single_turn else generated,
    )


Responses = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``[B, R]`` token ids (pad after the response), ``[B]`` lengths, ``[B, R]`` float32 logprobs (0
after), ``[B, R]`` weight versions (any value after) and ``[B, R]`` bool: sampled by the model."""


def sampled_responses(episodes: list[Episode], pad_token_id: int) -> Responses | None:
    """The responses as rows of the ``GenerationOutput``s every episode's only turn came from (one
    per generation request: per group when the rollout streams), cut where each episode's room
    ended, with no trip through Python lists; None when some episode had more than one turn."""
    if not episodes or any(e.sampled is None for e in episodes):
        return None
    lengths = torch.tensor([len(e.tokens) for e in episodes], dtype=torch.long)
    width = int(lengths.max())
    outputs: dict[int, tuple[Any, list[int], list[int]]] = {}  # id(out) -> (out, positions, rows)
    for position, episode in enumerate(episodes):
        out, row = episode.sampled
        entry = outputs.setdefault(id(out), (out, [], []))
        entry[1].append(position)
        entry[2].append(row)
    parts, order = [], []
    def cut(t: torch.Tensor, index: torch.Tensor, value: float) -> torch.Tensor:
        t = t.cpu()[index, :width]
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    for out, positions, rows in outputs.values():
        index = torch.tensor(rows, dtype=torch.long)
        versions = cut(out.token_weight_versions, index, out.weight_version) if out.token_weight_versions is not None \
            else torch.full((len(rows), width), out.weight_version, dtype=torch.long)
        parts.append((cut(out.response_ids, index, pad_token_id).long(), cut(out.logprobs, index, 0.0).float(),
                      versions.long()))
        order += positions
    ids, logprobs, versions = (torch.cat([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in range(3))
    if len(parts) > 1:  # back to the episodes' order
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        ids, logprobs, versions = ids[inverse], logprobs[inverse], versions[inverse]
    kept = torch.arange(width)[None, :] < lengths[:, None]
    return (torch.where(kept, ids, pad_token_id), lengths, torch.where(kept, logprobs, 0.0), versions, kept)


def listed_responses(episodes: list[Episode], pad_token_id: int) -> Responses:
    """The responses from each episode's token lists (multi-turn, agents): every turn, the
    environment's tokens between the assistant's."""
    width = max((len(e.tokens) for e in episodes), default=0)

    def right(rows: list[list[Any]], value: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=dtype).reshape(-1, width)

    return (right([e.tokens for e in episodes], pad_token_id, torch.long),
            torch.tensor([len(e.tokens) for e in episodes], dtype=torch.long),
            right([e.logprobs for e in episodes], 0.0, torch.float32), right([e.versions for e in episodes], 0, torch.long),
            right([e.generated for e in episodes], False, torch.bool))


def rollout_metrics(batches: list[RolloutBatch], trivial: torch.Tensor) -> dict[str, float]:
    """Statistics of every row generated this step (all generation batches), valid rewards only."""
    valid = torch.cat([b.reward_valid for b in batches])
    missing = torch.cat([b.reward_missing for b in batches])
    rewards = torch.cat([b.rewards for b in batches])[valid]
    lengths = torch.cat([b.generated_lengths for b in batches])
    metrics = {
        "reward/mean": float(rewards.mean()) if rewards.numel() else float("nan"),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/num_failed": float((~valid & ~missing).sum()),
        "reward/num_no_reward": float(missing.sum()),
        "response_length/mean": float(lengths.float().mean()),
        "truncated_fraction": float(torch.cat([b.truncated for b in batches]).float().mean()),
        "trivial_group_fraction": float(trivial.float().mean()),
        "generation/weight_version": float(batches[-1].weight_version),
        "generated_tokens": float(lengths.sum()),
    }
    for name in batches[0].reward_components:
        component = torch.cat([b.reward_components[name] for b in batches])[valid]
        metrics[f"reward/{name}"] = float(component.mean()) if component.numel() else float("nan")
    logs = [log for b in batches for log in b.message_logs]
    if any(b.generated_mask is not None for b in batches) or any(m.flags for log in logs for m in log):
        metrics.update(episode_metrics(logs))
    return metrics


def example_of(rollouts: RolloutBatch | TrainBatch | None) -> dict[str, Any] | None:
    """The first sample of a step's batch, for the end-of-run summary."""
    if rollouts is None or rollouts.batch_size == 0:
        return None
    log = rollouts.message_logs[0]
    return {"prompt": prompt_message(log).content, "response": log[-1].content, "reward": float(rollouts.rewards[0]),
            "valid": rollouts.reward_valid is None or bool(rollouts.reward_valid[0])}
