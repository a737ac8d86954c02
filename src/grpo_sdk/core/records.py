"""Records that cross the protocol boundaries.

Conventions, once for every record:

* Rows are samples: ``B = num_prompts_per_step * num_generations_per_prompt``; the rows of one
  prompt share a ``group_id``.
* Token tensors are *input-aligned* ``[B, S]``: column ``t`` of a logprob tensor holds
  ``log p(token_t | tokens_<t)``, so column 0 is always 0. Prompts are left-padded and responses
  right-padded, so every response starts at the same column.
* ``token_mask`` is 1 exactly on generated tokens, up to and including the token that stopped
  the sequence; ``sample_mask`` (one float per row) removes whole samples from the loss.

Records holding tensors use ``eq=False``: comparing tensors with ``==`` does not give a bool.
This module imports no torch; tensor fields are typed for readers and type checkers only.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import attrs

if TYPE_CHECKING:
    from torch import Tensor


class RunStatus(enum.StrEnum):
    """How a run ended: ``summary.json``'s ``status``, the ``status`` the ``grpo_run_end`` hook gets.

    A ``str`` enum, so ``status == "completed"`` works and JSON holds the plain value."""

    COMPLETED = "completed"  # reached grpo.max_num_steps or grpo.max_num_epochs
    EARLY_STOP = "early_stop"  # grpo.stop_at_validation_metric reached its threshold
    DEADLINE = "deadline"  # checkpointing.checkpoint_must_save_by: saved before the allocation ends
    INTERRUPTED = "interrupted"  # a stop signal (summary.json's reason names it) or Ctrl-C
    FAILED = "failed"  # an error; the latest checkpoint is intact
    ALREADY_FINISHED = "already_finished"  # resumed a run that had reached its end: nothing done


@attrs.frozen(kw_only=True)
class RunSummary:
    """What a run did: ``grpo_sdk.train`` returns it, ``<run_dir>/summary.json`` holds it as JSON."""

    status: RunStatus
    steps: int
    seconds: float  # wall time of this process's training
    reward_first: float  # mean reward of the first step: the starting level
    reward_last: float  # mean reward over the last min(10, steps) steps
    validation: dict[str, float]  # the last validation's metrics
    run_dir: Path
    checkpoint: Path | None  # the latest checkpoint: policy/ inside is a Hugging Face model directory
    example: dict[str, Any] | None  # one sample of the last step
    reason: str | None = None  # why an interrupted run stopped: the signal's name (SIGTERM, SIGINT, SIGHUP)
    metrics: dict[str, float] = attrs.field(factory=dict)  # the last step's logged metrics (train and val)
    # A completed run that stopped before grpo.max_num_steps because the dataset's epochs ran out:
    # "grpo.max_num_epochs"; None otherwise.
    ended_by: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self, recurse=False), "status": str(self.status), "run_dir": str(self.run_dir),
                "checkpoint": str(self.checkpoint) if self.checkpoint else None}


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample responses."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None or 0: no top-k filter
    stop_token_ids: tuple[int, ...] = ()  # stop on these as well as on the tokenizer's EOS
    seed: int | None = None  # sample from this seed, leaving the backend's own RNG untouched (validation)
    # Do not stop at the tokenizer's EOS (stop_token_ids still stop): rows run to their budget. vLLM's
    # ignore_eos; benchmarks use it to make every sampler decode the same per-row lengths.
    ignore_eos: bool = False


@attrs.frozen(kw_only=True)
class Message:
    """One turn of a conversation, with the exact token ids the policy is trained on."""

    role: str  # "system", "user", "assistant", "tool" (a tool's result), "environment"
    content: str
    token_ids: tuple[int, ...] = ()
    generation_logprobs: tuple[float, ...] | None = None  # set on generated (assistant) turns
    # What the environment found wrong with a generated turn (EnvironmentReturn.flags): "invalid_tool_call",
    # "malformed_thinking"; grpo.invalid_tool_call_advantage / malformed_thinking_advantage act on them.
    flags: tuple[str, ...] = ()


MessageLog = list[Message]


@attrs.frozen(kw_only=True, eq=False)
class GenerationInput:
    """Left-padded prompt tokens for one generation call."""

    input_ids: Tensor  # [B, P] long, left-padded with pad_token_id
    attention_mask: Tensor  # [B, P] long, 0 on padding
    # [B] long: each row's own token budget, at most SamplingParams.max_new_tokens (a multi-turn episode's
    # room left); None: max_new_tokens for every row. A backend that cannot honour it decodes up to
    # max_new_tokens, and the rollout cuts the row at its budget.
    max_new_tokens: Tensor | None = None
    # [B] long: each row's sampling seed, so a row samples the same tokens whatever else is in the batch
    # (vLLM's per-request seed); None: the backend draws them from its own RNG (SamplingParams.seed, if set).
    seeds: Tensor | None = None


@attrs.frozen(kw_only=True, eq=False)
class GenerationOutput:
    """What a generation backend returns for a ``GenerationInput``.

    A weight update that lands while a request is in flight (the ``in_flight_weight_updates``
    capability) gives one response tokens of several versions: ``token_weight_versions`` says which
    weights sampled each token, ``weight_version`` is the oldest of them (a group's age is measured
    from it), and ``logprobs`` stay those of the distribution each token was actually sampled from.
    """

    response_ids: Tensor  # [B, R] long, right-padded with pad_token_id
    response_lengths: Tensor  # [B] long: generated tokens, including the stop token if sampled
    logprobs: Tensor  # [B, R] float: logprob of each sampled token under the sampling distribution; 0 on padding
    truncated: Tensor  # [B] bool: reached max_new_tokens without a stop token
    weight_version: int = 0  # the policy version whose weights sampled the oldest token of these samples
    # [B, R] long: the version that sampled each token, the oldest on padding; None: every token has weight_version
    token_weight_versions: Tensor | None = None


@attrs.frozen(kw_only=True)
class EnvironmentReturn:
    """What ``Environment.step`` returns for a batch of message logs.

    ``rewards`` maps a component name to one float per sample; the total reward of a sample is
    the sum of its components. A single-reward environment returns ``{"reward": [...]}``.

    ``None`` means "no reward" for that sample (a grader that does not apply to it), not a failure:
    a sample whose every component is None leaves the loss and its group's baseline and is counted
    in ``reward/num_no_reward``, whatever ``env.on_reward_error`` says; a None beside a component
    that scored counts 0. A failure is anything else that is not a finite number (NaN, text) or
    an exception: ``env.on_reward_error`` decides, and ``reward/num_failed`` counts it.

    Multi-turn (``MultiTurnEnvironment``, docs/multi-turn.md): ``step`` is called after every
    assistant turn with the episodes still going; ``rewards`` are that turn's (an episode's reward
    is the sum over its turns; None on a turn adds nothing), ``done`` False continues an episode
    with ``observations`` (one message or several: tool results, a user reply) appended as tokens,
    and ``metadata`` is what the next turn's ``step`` gets for that sample.
    """

    rewards: dict[str, list[float | None]]
    done: list[bool] | None = None  # None: every sample is done (single-turn)
    # The next environment turn of each sample (multi-turn only): a message, several, or None.
    observations: list[Message | Sequence[Message] | None] | None = None
    metadata: list[dict[str, Any]] | None = None  # updated per-sample metadata
    metrics: dict[str, float] = attrs.field(factory=dict)  # batch-level metrics, logged as env/<name>
    # Per sample: what was wrong with the assistant turn just scored ("invalid_tool_call",
    # "malformed_thinking"); recorded on that turn's Message.flags.
    flags: list[Sequence[str]] | None = None


@attrs.frozen(kw_only=True, eq=False)
class AdvantageInput:
    """What an advantage estimator gets for one step (``TrainBatch.advantage_input()``).

    ``mask`` is the token mask times the sample mask: the tokens that train. The rest is what some
    estimators need and others ignore: ``reward_components`` (name -> ``[B]``, as the environment
    returned them; GDPO normalises each), ``valid_mask`` (``[B]`` bool, rows whose reward is
    usable: a failed or missing reward leaves its group's baseline), the logprob tensors
    (``[B, S]``, input-aligned; ``prev_logprobs`` for estimators declaring the ``prev_logprobs``
    capability, ``teacher_logprobs`` for ``teacher_logprobs``, ``reference_logprobs`` when the KL
    penalty is on) and each row's ``metadata``. A new field always has a default, so an estimator
    written today keeps working.
    """

    rewards: Tensor  # [B] float, total reward (after the reward pipeline)
    group_ids: Tensor  # [B] long
    mask: Tensor  # [B, S] float
    reward_components: dict[str, Tensor] = attrs.field(factory=dict)
    valid_mask: Tensor | None = None  # [B] bool; None: every row
    sample_mask: Tensor | None = None  # [B] float
    generation_logprobs: Tensor | None = None
    prev_logprobs: Tensor | None = None
    reference_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    metadata: Sequence[dict[str, Any]] = ()


@attrs.define(kw_only=True, eq=False)
class TrainBatch:
    """The step record: everything the estimator, the loss and the policy see for one GRPO step.

    The rollout builds it (tokens, masks, rewards and their components, validity, the episodes);
    the training loop fills ``prev_logprobs``, ``reference_logprobs``, ``teacher_logprobs`` and
    ``advantages`` as the step proceeds, so no stage reads an earlier record. A policy backend
    slices it into micro-batches with ``rows``.
    """

    input_ids: Tensor  # [B, S] long
    attention_mask: Tensor  # [B, S] long
    token_mask: Tensor  # [B, S] float: 1 on generated tokens
    sample_mask: Tensor  # [B] float: 0 removes a sample from the loss
    generation_logprobs: Tensor  # [B, S] float, input-aligned
    group_ids: Tensor  # [B] long
    rewards: Tensor  # [B] float, total reward (after the reward pipeline)
    advantages: Tensor | None = None  # [B, S] float
    prev_logprobs: Tensor | None = None  # [B, S]; None: the loss uses the detached current logprobs
    reference_logprobs: Tensor | None = None  # [B, S]; None when there is no KL penalty
    # [B, ...] tensors a loss variant needs; the reward components are also here as "reward/<name>"
    extras: dict[str, Tensor] = attrs.field(factory=dict)
    teacher_logprobs: Tensor | None = None  # [B, S]; on-policy distillation's teacher, else None
    reward_components: dict[str, Tensor] = attrs.field(factory=dict)  # name -> [B], as the environment returned them
    reward_valid: Tensor | None = None  # [B] bool: False where the reward failed or was missing; None: all valid
    truncated: Tensor | None = None  # [B] bool: reached max_new_tokens without a stop token
    response_start: int = 0  # the column where every response starts (prompts are left-padded before it)
    # Per row: the episode as messages (every turn, with its flags) and the prompt's metadata.
    message_logs: Sequence[Sequence[Message]] = ()
    metadata: Sequence[dict[str, Any]] = ()

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_mask(self) -> Tensor:
        """``[B, S]``: the tokens that train (token mask times sample mask)."""
        return self.token_mask * self.sample_mask[:, None]

    def advantage_input(self) -> AdvantageInput:
        return AdvantageInput(
            rewards=self.rewards, group_ids=self.group_ids, mask=self.loss_mask,
            reward_components=self.reward_components, valid_mask=self.reward_valid, sample_mask=self.sample_mask,
            generation_logprobs=self.generation_logprobs, prev_logprobs=self.prev_logprobs,
            reference_logprobs=self.reference_logprobs, teacher_logprobs=self.teacher_logprobs,
            metadata=self.metadata)

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop`` of every tensor (a micro-batch view, no copy)."""
        return self._map(lambda t: t[start:stop], lambda rows: rows[start:stop])

    def select(self, rows: Sequence[int]) -> TrainBatch:
        """The ``rows`` (positions, in order) of every tensor: a copy."""
        import torch  # records import no torch at module level

        index = torch.tensor(list(rows), dtype=torch.long)
        return self._map(lambda t: t[index.to(t.device)], lambda per_row: [per_row[i] for i in rows] if per_row else per_row)

    def to(self, device: Any) -> TrainBatch:
        return self._map(lambda t: t.to(device), lambda rows: rows)

    def _map(self, fn, per_row) -> TrainBatch:
        mapped = {}
        for field in attrs.fields(TrainBatch):
            value = getattr(self, field.name)
            if isinstance(value, dict):
                value = {k: fn(t) for k, t in value.items()}
            elif field.name in ("message_logs", "metadata"):
                value = per_row(value)
            elif value is not None and field.name != "response_start":
                value = fn(value)
            mapped[field.name] = value
        return TrainBatch(**mapped)


@attrs.frozen(kw_only=True)
class SyncStats:
    """What a weight sync reports."""

    version: int
    num_tensors: int
    num_bytes: int
    seconds: float
