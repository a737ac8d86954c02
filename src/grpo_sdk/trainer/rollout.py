"""Rollouts: tokenize prompts, generate G responses each, score them, build the batch.

Decoding and the loss mask stop at the same place, the first stop token or ``max_new_tokens``
(a prototype that decoded up to ``<pad>`` but masked up to ``<eos>`` taught the policy to emit
``<pad>`` as a terminator). Any other special token inside a response is decoded as text, so
the environment sees it and scores it as wrong.

The message log an environment gets: ``[user, assistant]`` for a plain prompt (the user message
holds the prompt as the model saw it, templates applied, and its token ids); for a
conversational row the row's own messages (raw content, no token ids: the chat template rendered
them together) followed by the assistant message. The assistant message holds the response's
token ids and generation logprobs either way.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import torch

from grpo_sdk.trainer.data import Prompt, PromptBuilder
from grpo_sdk.core.errors import DataError, EnvironmentStepError
from grpo_sdk.core.records import EnvironmentReturn, GenerationInput, Message, SamplingParams, TrainBatch
from grpo_sdk.runtime.deadlines import CallTimeout, WorkerError


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


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def prompt_message(log: Sequence[Message]) -> Message:
    """The message a response answers: the last non-assistant message before it (``log[0]`` of a
    plain prompt's ``[user, assistant]``; the last user turn of a conversation)."""
    for message in reversed(log[:-1]):
        if message.role != "assistant":
            return message
    return log[0]


def prompt_log(prompt: Prompt, prompt_ids: Sequence[int]) -> list[Message]:
    """The messages before the response: the row's own for a conversational prompt, else one user message."""
    if prompt.messages is not None:
        return [Message(role=m["role"], content=m["content"]) for m in prompt.messages]
    return [Message(role="user", content=prompt.text, token_ids=tuple(prompt_ids))]


class RewardFailure(Exception):
    pass


def _check_return(ret: Any, size: int) -> EnvironmentReturn:
    if not isinstance(ret, EnvironmentReturn) or not ret.rewards:
        raise RewardFailure(f"step() returned {type(ret).__name__}, not an EnvironmentReturn with rewards")
    for name, values in ret.rewards.items():
        if len(values) != size:
            raise RewardFailure(f"reward {name!r} has {len(values)} values for {size} samples")
    return ret


def _as_reward(value: Any) -> float | None:
    """A reward as a float, or None when it is not a finite real number (None, text, NaN, a many-element tensor)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _check_metrics(metrics: Any, env_name: str) -> dict[str, float]:
    """The environment's metrics as finite-or-not floats; anything else is an error naming the key."""
    if not isinstance(metrics, dict):
        raise EnvironmentStepError(f"environment {env_name!r} returned metrics of type {type(metrics).__name__}; "
                                   "EnvironmentReturn.metrics must be a dict of name -> number")
    out = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError, OverflowError):
            raise EnvironmentStepError(f"environment {env_name!r} returned metric {key!r} = {value!r}, which is not "
                                       "a number; EnvironmentReturn.metrics values must be numbers") from None
    return out


def score(environment: Any, env_name: str, logs: list[list[Message]], metadata: list[dict[str, Any]],
          sources: list[str], on_error: str
          ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rewards per component ``[B]``, a ``[B]`` bool of usable rewards, a ``[B]`` bool of samples
    with no reward, and env metrics.

    A reward of None means "no reward" (``EnvironmentReturn``): a sample whose every component is
    None leaves the loss and the baseline like a failure, but is no failure (never raised, not in
    ``env.max_failed_fraction``); a None next to a number counts 0. If the batched call raises,
    each sample is retried alone to find which ones fail, so the error (or the masking) names the
    sample instead of the whole batch.
    """
    size = len(logs)
    entries: list[dict[str, float] | Exception]

    def describe(i: int) -> str:
        return (f"sample {i} ({sources[i]}, prompt {_short(prompt_message(logs[i]).content)}, "
                f"response {_short(logs[i][-1].content)})")

    try:
        ret = _check_return(environment.step(logs, metadata), size)
        names, metrics = sorted(ret.rewards), _check_metrics(ret.metrics, env_name)
        entries = [{n: ret.rewards[n][i] for n in names} for i in range(size)]
    except WorkerError:
        raise  # a lost or stuck worker says nothing about the samples: never retried, never masked
    except EnvironmentStepError:
        raise
    except Exception as batch_error:  # noqa: BLE001 - attribute the failure (or the hang) to samples
        singles: list[EnvironmentReturn | Exception] = []
        for i in range(size):
            try:
                singles.append(_check_return(environment.step([logs[i]], [metadata[i]]), 1))
            except WorkerError:
                raise
            except CallTimeout as exc:  # a hang is not a bad reward: stop, naming the sample, whatever on_error says
                raise EnvironmentStepError(f"environment {env_name!r} did not return a reward for {describe(i)} "
                                           f"within {exc.elapsed:g} s (cluster.call_timeout_s); the run stops "
                                           "rather than wait forever") from exc
            except Exception as exc:  # noqa: BLE001
                singles.append(exc)
        ok = [r for r in singles if isinstance(r, EnvironmentReturn)]
        if len(ok) == size:
            raise EnvironmentStepError(f"environment {env_name!r} failed on the batch but on no single sample: "
                                       f"{type(batch_error).__name__}: {batch_error}") from batch_error
        names, metrics = (sorted(ok[0].rewards) if ok else ["reward"]), {}
        entries = [r if isinstance(r, Exception) else {n: r.rewards.get(n, [math.nan])[0] for n in names}
                   for r in singles]

    rewards = {name: torch.zeros(size, dtype=torch.float32) for name in names}
    valid = torch.ones(size, dtype=torch.bool)
    missing = torch.zeros(size, dtype=torch.bool)
    for i, entry in enumerate(entries):
        present = {} if isinstance(entry, Exception) else {n: v for n, v in entry.items() if v is not None}
        if not isinstance(entry, Exception) and not present:
            missing[i], valid[i] = True, False  # no reward: out of the loss and the baseline, not a failure
            continue
        failure = entry if isinstance(entry, Exception) else next(
            (RewardFailure(f"reward {n!r} is {v!r}, not a finite number") for n, v in present.items()
             if _as_reward(v) is None), None)
        if failure is None:
            for name, value in present.items():  # a None beside a scored component counts 0
                rewards[name][i] = _as_reward(value)
        elif on_error == "raise":
            raise EnvironmentStepError(
                f"environment {env_name!r} failed on {describe(i)}: {type(failure).__name__}: {failure} "
                "(env.on_reward_error=mask drops such samples from the loss instead)") from failure
        else:
            valid[i] = False  # its reward stays 0 and it leaves the loss and the baseline
    return rewards, valid, missing, metrics


@attrs.define(kw_only=True, eq=False)
class RolloutBatch:
    """Scored rollouts, before they become a TrainBatch.

    Prompts stay left-padded and responses right-padded in separate tensors, so batches from
    several generation rounds (dynamic sampling) can be filtered by row and concatenated.
    """

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, R] right-padded
    response_lengths: torch.Tensor  # [B]
    generation_logprobs: torch.Tensor  # [B, R]
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

    @property
    def batch_size(self) -> int:
        return int(self.prompt_ids.shape[0])

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

        versions = None
        if any(b.token_weight_versions is not None for b in batches):
            versions = torch.cat([torch.nn.functional.pad(
                b.token_weight_versions if b.token_weight_versions is not None
                else torch.full(b.response_ids.shape, b.weight_version, dtype=torch.long),
                (0, response_width - b.response_ids.shape[1]), value=b.weight_version) for b in batches])
        return RolloutBatch(
            token_weight_versions=versions,
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
            token_mask=torch.cat([torch.zeros_like(self.prompt_ids), response_mask], dim=1).float(),
            sample_mask=sample_mask,
            generation_logprobs=torch.cat([torch.zeros(self.prompt_ids.shape), self.generation_logprobs], dim=1),
            group_ids=self.group_ids,
            rewards=self.rewards,
            extras={f"reward/{name}": value for name, value in self.reward_components.items()},
        )


def collect_rollouts(*, prompts: list[Prompt], tokenizer: Any, generation: Any, environment: Any, cfg: Any,
                     sampling: SamplingParams, max_prompt_tokens: int, group_offset: int,
                     num_generations: int | None = None) -> tuple[RolloutBatch, dict[str, float]]:
    """Generate ``num_generations`` (default ``grpo.num_generations_per_prompt``) responses per
    prompt and score them."""
    G = num_generations or cfg.grpo.num_generations_per_prompt
    prompt_ids = tokenize_prompts(tokenizer, prompts, max_prompt_tokens)
    rows = [ids for ids in prompt_ids for _ in range(G)]
    row_prompts = [p for p in prompts for _ in range(G)]
    input_ids, attention_mask = left_pad(rows, tokenizer.pad_token_id)

    generation.prepare_for_generation()
    out = generation.generate(GenerationInput(input_ids=input_ids, attention_mask=attention_mask), sampling)
    generation.finish_generation()

    lengths = out.response_lengths.tolist()
    truncated = out.truncated.tolist()
    response_rows = out.response_ids.tolist()
    logprob_rows = out.logprobs.tolist()
    logs, metadata = [], []
    for i, prompt in enumerate(row_prompts):
        tokens = response_rows[i][:lengths[i]]
        text_tokens = tokens if truncated[i] else tokens[:-1]  # drop the stop token from the text
        text = tokenizer.decode(text_tokens, skip_special_tokens=False)
        logs.append([*prompt_log(prompt, rows[i]),
                     Message(role="assistant", content=text, token_ids=tuple(tokens),
                             generation_logprobs=tuple(logprob_rows[i][:lengths[i]]))])
        metadata.append(dict(prompt.metadata))
    rewards, valid, missing, env_metrics = score(environment, cfg.env.name, logs, metadata,
                                                 [p.source for p in row_prompts], cfg.env.on_reward_error)
    batch = RolloutBatch(
        prompt_ids=input_ids, prompt_mask=attention_mask, response_ids=out.response_ids,
        response_lengths=out.response_lengths, generation_logprobs=out.logprobs, truncated=out.truncated.bool(),
        group_ids=torch.arange(group_offset, group_offset + len(prompts)).repeat_interleave(G),
        reward_components=rewards, reward_valid=valid, reward_missing=missing, message_logs=logs, metadata=metadata,
        pad_token_id=tokenizer.pad_token_id, weight_version=out.weight_version,
        token_weight_versions=out.token_weight_versions,
    )
    return batch, {f"env/{k}": float(v) for k, v in env_metrics.items()}


def rollout_metrics(batches: list[RolloutBatch], trivial: torch.Tensor) -> dict[str, float]:
    """Statistics of every row generated this step (all generation batches), valid rewards only."""
    valid = torch.cat([b.reward_valid for b in batches])
    missing = torch.cat([b.reward_missing for b in batches])
    rewards = torch.cat([b.rewards for b in batches])[valid]
    lengths = torch.cat([b.response_lengths for b in batches])
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
    return metrics


def example_of(rollouts: RolloutBatch | None) -> dict[str, Any] | None:
    """The first sample of a batch, for the end-of-run summary."""
    if rollouts is None or rollouts.batch_size == 0:
        return None
    log = rollouts.message_logs[0]
    return {"prompt": prompt_message(log).content, "response": log[-1].content, "reward": float(rollouts.rewards[0]),
            "valid": bool(rollouts.reward_valid[0])}
