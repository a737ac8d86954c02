"""One round of rollouts: tokenize prompts, generate G responses each, score them, build the batch.

Decoding and the loss mask stop at the same place, the first stop token or ``max_new_tokens``
(a prototype that decoded up to ``<pad>`` but masked up to ``<eos>`` taught the policy to emit
``<pad>`` as a terminator). Any other special token inside a response is decoded as text, so
the environment sees it and scores it as wrong.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from grpo_sdk.core.data import Prompt
from grpo_sdk.core.errors import DataError, EnvironmentStepError
from grpo_sdk.core.records import EnvironmentReturn, GenerationInput, Message, SamplingParams, TrainBatch


def tokenize_prompts(tokenizer: Any, prompts: Sequence[Prompt], max_prompt_tokens: int) -> list[list[int]]:
    ids = tokenizer([p.text for p in prompts], add_special_tokens=True)["input_ids"]
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


class RewardFailure(Exception):
    pass


def _check_return(ret: Any, size: int) -> EnvironmentReturn:
    if not isinstance(ret, EnvironmentReturn) or not ret.rewards:
        raise RewardFailure(f"step() returned {type(ret).__name__}, not an EnvironmentReturn with rewards")
    for name, values in ret.rewards.items():
        if len(values) != size:
            raise RewardFailure(f"reward {name!r} has {len(values)} values for {size} samples")
    return ret


def score(environment: Any, env_name: str, logs: list[list[Message]], metadata: list[dict[str, Any]],
          sources: list[str], on_error: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, float]]:
    """Rewards per component ``[B]``, a ``[B]`` bool of usable rewards, and env metrics.

    If the batched call raises, each sample is retried alone to find which ones fail, so the
    error (or the masking) names the sample instead of the whole batch.
    """
    size = len(logs)
    entries: list[dict[str, float] | Exception]
    try:
        ret = _check_return(environment.step(logs, metadata), size)
        names, metrics = sorted(ret.rewards), dict(ret.metrics)
        entries = [{n: ret.rewards[n][i] for n in names} for i in range(size)]
    except Exception as batch_error:  # noqa: BLE001 - attribute the failure to samples
        singles: list[EnvironmentReturn | Exception] = []
        for i in range(size):
            try:
                singles.append(_check_return(environment.step([logs[i]], [metadata[i]]), 1))
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
    for i, entry in enumerate(entries):
        failure = entry if isinstance(entry, Exception) else next(
            (RewardFailure(f"reward {n!r} is {v}") for n, v in entry.items() if not math.isfinite(float(v))), None)
        if failure is None:
            for name, value in entry.items():
                rewards[name][i] = float(value)
        elif on_error == "raise":
            raise EnvironmentStepError(
                f"environment {env_name!r} failed on sample {i} ({sources[i]}, prompt {_short(logs[i][0].content)}, "
                f"response {_short(logs[i][-1].content)}): {type(failure).__name__}: {failure} "
                "(env.on_reward_error=mask drops such samples from the loss instead)") from failure
        else:
            valid[i] = False  # its reward stays 0 and it leaves the loss and the baseline
    return rewards, valid, metrics


def collect_rollouts(*, prompts: list[Prompt], tokenizer: Any, generation: Any, environment: Any, cfg: Any,
                     sampling: SamplingParams, max_prompt_tokens: int, group_offset: int
                     ) -> tuple[TrainBatch, dict[str, float], list[dict[str, Any]]]:
    """Generate ``num_generations_per_prompt`` responses per prompt and score them."""
    G = cfg.grpo.num_generations_per_prompt
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
        logs.append([
            Message(role="user", content=prompt.text, token_ids=tuple(rows[i])),
            Message(role="assistant", content=text, token_ids=tuple(tokens),
                    generation_logprobs=tuple(logprob_rows[i][:lengths[i]])),
        ])
        metadata.append(dict(prompt.metadata))
    rewards, valid, env_metrics = score(environment, cfg.env.name, logs, metadata,
                                        [p.source for p in row_prompts], cfg.env.on_reward_error)
    total = torch.stack(list(rewards.values())).sum(0)

    width = out.response_ids.shape[1]
    response_mask = (torch.arange(width)[None, :] < out.response_lengths[:, None]).long()
    batch = TrainBatch(
        input_ids=torch.cat([input_ids, out.response_ids], dim=1),
        attention_mask=torch.cat([attention_mask, response_mask], dim=1),
        token_mask=torch.cat([torch.zeros_like(input_ids), response_mask], dim=1).float(),
        sample_mask=valid.float(),
        generation_logprobs=torch.cat([torch.zeros(input_ids.shape), out.logprobs], dim=1),
        group_ids=torch.arange(group_offset, group_offset + len(prompts)).repeat_interleave(G),
        rewards=total,
        extras={f"reward/{name}": value for name, value in rewards.items()},
    )
    n_tokens = int(out.response_lengths.sum())
    metrics = {
        "reward/mean": float(total[valid].mean()) if valid.any() else float("nan"),
        "reward/std": float(total[valid].std()) if valid.sum() > 1 else 0.0,
        **{f"reward/{name}": float(v[valid].mean()) if valid.any() else float("nan") for name, v in rewards.items()},
        "reward/num_failed": float((~valid).sum()),
        "response_length/mean": n_tokens / len(rows),
        "truncated_fraction": float(out.truncated.float().mean()),
        "generation/weight_version": float(out.weight_version),
        "generated_tokens": float(n_tokens),
        **{f"env/{k}": float(v) for k, v in env_metrics.items()},
    }
    samples = [{"prompt": log[0].content, "response": log[-1].content, "reward": float(total[i]),
                "valid": bool(valid[i])} for i, log in enumerate(logs)]
    return batch, metrics, samples
