"""The asynchronous loop's replay buffer: scored prompt groups waiting for the step they target.

A group is one prompt's G rows of a ``RolloutBatch``, tagged with the weight version that generated
it and the training step it was claimed for (docs/async.md). The collector ``put``\\s groups; the
trainer ``take``\\s exactly ``num_prompts_per_step`` groups of its step, sorted by ordinal (the group
id the synchronous loop counts), so a batch's composition never depends on completion order.

Invariants, checked where they can first be broken (an ``ReplayBufferError`` names the group):

* a group has G rows, all with its ordinal as group id, and ``target - A <= version <= target``;
* at most P groups per target, at most ``(A + 1) * P`` in all (exact reservation never reaches it),
  no ordinal twice, nothing for a target already taken;
* ``take`` removes groups only when it returns them: a short target returns None and keeps them
  (NeMo-RL dropped a wrong-size batch after removing it, losing its trajectories).

Checkpoint files (inside the checkpoint's directory, so its manifest checksums them; no pickle):
``buffer.json`` (settings, and per group its tags, messages and metadata) and
``buffer.safetensors`` (every tensor of each group as ``"{ordinal}/{field}"``, trimmed to the
group's own widths). ``read`` keeps what the resumed run can still train; a run resumed with
``checkpointing.load_replay_buffer=false`` does not call it and starts from
``ReplayBuffer(..., taken_through=step - 1)``, regenerating every ordinal from the cut.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from grpo_sdk.core.errors import ConfigError, GrpoSdkError
from grpo_sdk.core.files import fsync_dir, write_text_atomic
from grpo_sdk.core.records import Message
from grpo_sdk.rollouts.rollout import RolloutBatch

BUFFER_JSON = "buffer.json"
BUFFER_TENSORS = "buffer.safetensors"
FORMAT = 1
# Row tensors padded along dim 1 -> padded on the left (prompts) or the right (responses, token versions).
_PADDED = {"prompt_ids": True, "prompt_mask": True, "response_ids": False, "generation_logprobs": False}
_ROWS = ("response_lengths", "truncated", "group_ids", "reward_valid", "reward_missing", "rewards", "unshaped_rewards")


class ReplayBufferError(GrpoSdkError):
    """A group broke the buffer's invariants: a bug in whatever produced it, never a user error."""


class BufferFileError(GrpoSdkError):
    """``buffer.json`` / ``buffer.safetensors`` cannot be written (metadata JSON cannot hold) or read."""


@attrs.frozen(kw_only=True, eq=False)
class BufferedGroup:
    """One prompt group: ``rollouts`` holds its G rows. ``weight_version`` is the oldest weights any
    of its tokens came from (its age counts from it), ``last_weight_version`` the newest."""

    ordinal: int
    target_step: int
    weight_version: int
    last_weight_version: int
    epoch: int
    rollouts: RolloutBatch
    generation_seconds: float = 0.0
    attempts: int = 1
    token_weight_versions: torch.Tensor | None = None  # [G, R] long; None: every token has weight_version

    def describe(self) -> str:
        return f"prompt group {self.ordinal} (target step {self.target_step}, weight version {self.weight_version})"


@attrs.frozen(kw_only=True, eq=False)
class TakenBatch:
    """What ``take`` returns: the step's groups by ordinal and their rows as one batch."""

    step: int
    max_age: int
    groups: tuple[BufferedGroup, ...]
    rollouts: RolloutBatch
    buffer_size: int  # groups left in the buffer after the take

    @property
    def avg_trajectory_age(self) -> float:
        return self.step - sum(g.weight_version for g in self.groups) / len(self.groups)

    @property
    def age_fractions(self) -> dict[int, float]:
        """Fraction of the groups of each age ``0 ... max_age`` (age = step - weight version)."""
        ages = [self.step - g.weight_version for g in self.groups]
        return {k: ages.count(k) / len(ages) for k in range(self.max_age + 1)}

    def metrics(self) -> dict[str, float]:
        out = {"train/buffer_size": float(self.buffer_size), "train/avg_trajectory_age": self.avg_trajectory_age,
               **{f"train/trajectory_age/{k}": v for k, v in self.age_fractions.items()}}
        if any(g.last_weight_version != g.weight_version for g in self.groups):  # an update landed in flight
            ages, tokens = 0.0, 0
            for g in self.groups:
                sampled = g.rollouts.sampled
                versions = g.token_weight_versions if g.token_weight_versions is not None \
                    else torch.full(sampled.shape, g.weight_version)
                ages += float((self.step - versions[:, :sampled.shape[1]][sampled]).sum())
                tokens += int(sampled.sum())
            out["train/token_age_mean"] = ages / max(tokens, 1)
            out["train/in_flight_groups"] = sum(g.last_weight_version != g.weight_version
                                                for g in self.groups) / len(self.groups)
        return out


@attrs.frozen(kw_only=True)
class TargetStatus:
    """One target step's groups in the buffer, for starvation reports."""

    target_step: int
    needed: int
    ordinals: tuple[int, ...]
    weight_versions: tuple[int, ...]
    generation_seconds: tuple[float, ...]
    max_response_length: int

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self, value_serializer=lambda _, __, v: list(v) if isinstance(v, tuple) else v)


class ReplayBuffer:
    """Thread-safe: every method takes the one condition's lock; ``wait_for`` sleeps on it.

    Example::

        buffer = ReplayBuffer(num_prompts_per_step=4, num_generations=2, max_age=1)
        buffer.put(group)                        # collector thread
        if buffer.wait_for(step, timeout=0.25):  # trainer: poll, check the collector, poll again
            taken = buffer.take(step)
    """

    def __init__(self, *, num_prompts_per_step: int, num_generations: int, max_age: int,
                 schedule: str = "deterministic", taken_through: int | None = None):
        self.num_prompts_per_step = num_prompts_per_step
        self.num_generations = num_generations
        self.max_age = max_age
        self.schedule = schedule
        self.capacity = (max_age + 1) * num_prompts_per_step
        self.taken_through = taken_through  # every target <= this has been trained (or precedes a resume)
        self.groups_put = 0
        self.last_put_at: float | None = None  # time.monotonic() of the newest put: the trainer's progress deadline
        self._targets: dict[int, dict[int, BufferedGroup]] = {}
        self._cond = threading.Condition()
        self._wakeups = 0

    @property
    def size(self) -> int:
        with self._cond:
            return sum(len(groups) for groups in self._targets.values())

    def put(self, group: BufferedGroup) -> None:
        """Add a finished group; a group that breaks an invariant raises, naming it, and is not added."""
        with self._cond:
            self._check_group(group, group.target_step)
            where = group.describe()
            if self.taken_through is not None and group.target_step <= self.taken_through:
                raise ReplayBufferError(f"{where}: step {group.target_step} was already trained "
                                        f"(the buffer has taken every step up to {self.taken_through})")
            if any(group.ordinal in groups for groups in self._targets.values()):
                raise ReplayBufferError(f"{where}: the buffer already holds a group with ordinal {group.ordinal}")
            target = self._targets.get(group.target_step, {})
            if len(target) >= self.num_prompts_per_step:
                raise ReplayBufferError(f"{where}: step {group.target_step} already has its "
                                        f"{self.num_prompts_per_step} groups (grpo.num_prompts_per_step)")
            if self.size >= self.capacity:
                raise ReplayBufferError(f"{where}: the buffer is full ({self.capacity} groups = (max_age + 1) x "
                                        f"num_prompts_per_step, targets {sorted(self._targets)})")
            pads = {g.rollouts.pad_token_id for t in self._targets.values() for g in t.values()}
            if pads and group.rollouts.pad_token_id not in pads:
                raise ReplayBufferError(f"{where}: pad token id {group.rollouts.pad_token_id}, the buffer's "
                                        f"groups have {pads.pop()}")
            # The group's version is authoritative (the oldest token's); its batch carries the same.
            rollouts = attrs.evolve(group.rollouts, weight_version=group.weight_version)
            self._targets.setdefault(group.target_step, {})[group.ordinal] = attrs.evolve(group, rollouts=rollouts)
            self.groups_put += 1
            self.last_put_at = time.monotonic()
            self._cond.notify_all()

    def complete(self, step: int) -> bool:
        with self._cond:
            return len(self._targets.get(step, ())) >= self.num_prompts_per_step

    def wait_for(self, step: int, timeout: float) -> bool:
        """Whether ``step`` has all its groups, waiting up to ``timeout`` s (less if ``wake`` is called)."""
        with self._cond:
            wakeups = self._wakeups
            self._cond.wait_for(lambda: self._wakeups != wakeups or self.complete(step), timeout)
            return self.complete(step)

    def wake(self) -> None:
        """End every ``wait_for`` now (the collector failed or stopped: the trainer should look)."""
        with self._cond:
            self._wakeups += 1
            self._cond.notify_all()

    def take(self, step: int) -> TakenBatch | None:
        """The P groups of ``step`` sorted by ordinal, removed; None (nothing removed) while some are missing."""
        with self._cond:
            if self.taken_through is not None and step <= self.taken_through:
                raise ReplayBufferError(f"step {step} was already taken (the buffer has taken every step up to "
                                        f"{self.taken_through})")
            target = self._targets.get(step, {})
            if len(target) < self.num_prompts_per_step:
                return None
            groups = tuple(target[o] for o in sorted(target))
            if len(groups) != self.num_prompts_per_step:
                raise ReplayBufferError(f"step {step} has {len(groups)} groups, not {self.num_prompts_per_step}: "
                                        f"ordinals {[g.ordinal for g in groups]}")
            for group in groups:
                self._check_group(group, step)
            batch = RolloutBatch.concat([g.rollouts for g in groups])
            del self._targets[step]  # only now: every check passed and the batch exists
            self.taken_through = step if self.taken_through is None else max(self.taken_through, step)
            self._cond.notify_all()
            return TakenBatch(step=step, max_age=self.max_age, groups=groups, rollouts=batch,
                              buffer_size=sum(len(t) for t in self._targets.values()))

    def targets(self) -> dict[int, TargetStatus]:
        """Each target in the buffer with its groups so far (ordinals, versions, durations)."""
        with self._cond:
            return {step: TargetStatus(
                target_step=step, needed=self.num_prompts_per_step, ordinals=tuple(sorted(groups)),
                weight_versions=tuple(groups[o].weight_version for o in sorted(groups)),
                generation_seconds=tuple(groups[o].generation_seconds for o in sorted(groups)),
                max_response_length=max(int(g.rollouts.response_lengths.max()) for g in groups.values()))
                for step, groups in sorted(self._targets.items()) if groups}

    def groups(self) -> list[BufferedGroup]:
        """Every group, by target then ordinal (a snapshot)."""
        with self._cond:
            return [t[o] for _, t in sorted(self._targets.items()) for o in sorted(t)]

    def _check_group(self, group: BufferedGroup, step: int) -> None:
        where, rows = group.describe(), group.rollouts.batch_size
        if rows != self.num_generations or len(group.rollouts.message_logs) != rows:
            raise ReplayBufferError(f"{where}: {rows} rows ({len(group.rollouts.message_logs)} message logs), not "
                                    f"{self.num_generations} (grpo.num_generations_per_prompt)")
        if not bool((group.rollouts.group_ids == group.ordinal).all()):
            raise ReplayBufferError(f"{where}: its rows have group ids {group.rollouts.group_ids.tolist()}, "
                                    f"not its ordinal {group.ordinal}")
        if not step - self.max_age <= group.weight_version <= step or group.last_weight_version < group.weight_version:
            raise ReplayBufferError(
                f"{where}: versions {group.weight_version}..{group.last_weight_version} are outside the window "
                f"[{step - self.max_age}, {step}] of step {step} (grpo.async_grpo.max_trajectory_age_steps="
                f"{self.max_age})")

    # -- checkpoint files ---------------------------------------------------------------------------------------

    def write(self, directory: Path, groups: list[BufferedGroup] | None = None) -> None:
        """``buffer.safetensors``, then ``buffer.json`` (each written whole or not at all), of every
        group or of ``groups`` (a snapshot the caller took with the state it saves alongside)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        groups = self.groups() if groups is None else groups
        tensors: dict[str, torch.Tensor] = {}
        entries = [_group_entry(g, tensors) for g in groups]
        document = {"format": FORMAT, "schedule": self.schedule, "max_age": self.max_age,
                    "num_prompts_per_step": self.num_prompts_per_step, "num_generations": self.num_generations,
                    "pad_token_id": groups[0].rollouts.pad_token_id if groups else None, "groups": entries}
        text = json.dumps(document)
        tmp = directory / f".{BUFFER_TENSORS}.tmp"
        save_file(tensors, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, directory / BUFFER_TENSORS)
        fsync_dir(directory)
        write_text_atomic(directory / BUFFER_JSON, text)

    @classmethod
    def read(cls, directory: Path, *, step: int, num_prompts_per_step: int, num_generations: int, max_age: int,
             schedule: str) -> tuple[ReplayBuffer, tuple[int, ...]]:
        """The buffer saved in ``directory``, for a run whose next step is ``step``, and the ordinals it
        dropped: those of targets before ``step`` and those outside their target's window. A buffer
        saved with other settings is a ``ConfigError`` naming each key."""
        directory = Path(directory)
        try:
            document = json.loads((directory / BUFFER_JSON).read_text(encoding="utf-8"))
            tensors = load_file(str(directory / BUFFER_TENSORS))
        except (OSError, ValueError, SafetensorError) as exc:
            raise BufferFileError(f"cannot read the replay buffer in {directory}: {type(exc).__name__}: {exc}. "
                                  "Resume from an earlier checkpoint, or set checkpointing.load_replay_buffer=false "
                                  "to regenerate its groups") from exc
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise BufferFileError(f"{directory / BUFFER_JSON}: not a replay buffer of format {FORMAT}")
        now = {"grpo.num_prompts_per_step": ("num_prompts_per_step", num_prompts_per_step),
               "grpo.num_generations_per_prompt": ("num_generations", num_generations),
               "grpo.async_grpo.schedule": ("schedule", schedule),
               "grpo.async_grpo.max_trajectory_age_steps": ("max_age", max_age)}
        problems = [(key, (f"the replay buffer in {directory} was saved with {document.get(field)!r}, this run has "
                           f"{value!r}: resume with the same value, or set checkpointing.load_replay_buffer=false to "
                           "start with an empty buffer")) for key, (field, value) in now.items()
                    if document.get(field) != value]
        if problems:
            raise ConfigError(problems)
        buffer = cls(num_prompts_per_step=num_prompts_per_step, num_generations=num_generations, max_age=max_age,
                     schedule=schedule, taken_through=step - 1)
        dropped = []
        for index, entry in enumerate(document.get("groups", [])):
            try:
                group = _group_from_entry(entry, tensors, document["pad_token_id"])
            except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
                raise BufferFileError(f"{directory}: group {index} of {BUFFER_JSON} cannot be rebuilt "
                                      f"({type(exc).__name__}: {exc})") from exc
            if group.target_step < step or not group.target_step - max_age <= group.weight_version <= group.target_step:
                dropped.append(group.ordinal)
                continue
            try:
                buffer.put(group)
            except ReplayBufferError as exc:
                raise BufferFileError(f"{directory}: {exc}") from exc
        return buffer, tuple(dropped)


def _trimmed(t: torch.Tensor, keep: int, left: bool) -> tuple[torch.Tensor, Any]:
    """``t`` cut to ``keep`` columns and the constant that filled the rest, or ``t`` whole (and None)
    when the cut part is not one constant: then nothing needs rebuilding."""
    cut = t[:, :t.shape[1] - keep] if left else t[:, keep:]
    if cut.numel() == 0:
        return t.clone(), None
    value = cut.flatten()[0]
    if not bool((cut == value).all()):  # NaN never equals itself, so a NaN fill is stored whole too
        return t.clone(), None
    kept = t[:, t.shape[1] - keep:] if left else t[:, :keep]
    return kept.clone().contiguous(), value.item()


def _group_entry(group: BufferedGroup, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    batch, key = group.rollouts, f"{group.ordinal}/"
    widths = {"prompt": int(batch.prompt_mask.sum(1).max()) if batch.batch_size else 0,
              "response": int(batch.response_lengths.max()) if batch.batch_size else 0}
    pads = {}
    fields = {name: getattr(batch, name) for name in _PADDED}
    if group.token_weight_versions is not None:
        fields["token_weight_versions"] = group.token_weight_versions
    if batch.generated_mask is not None:
        fields["generated_mask"] = batch.generated_mask
    for name, t in fields.items():
        left = _PADDED.get(name, False)
        stored, value = _trimmed(t, widths["prompt" if left else "response"], left)
        tensors[key + name] = stored
        if value is not None:
            pads[name] = [t.shape[1], value]
    for name in _ROWS:
        if getattr(batch, name) is not None:
            tensors[key + name] = getattr(batch, name).clone().contiguous()
    for name, t in batch.reward_components.items():
        tensors[f"{key}reward/{name}"] = t.clone().contiguous()
    where = group.describe()
    return {"ordinal": group.ordinal, "target_step": group.target_step, "weight_version": group.weight_version,
            "last_weight_version": group.last_weight_version, "epoch": group.epoch,
            "generation_seconds": group.generation_seconds, "attempts": group.attempts, "pads": pads,
            "messages": [_messages_entry(log, batch, i) for i, log in enumerate(batch.message_logs)],
            "metadata": [_jsonable(m, f"metadata of row {i} of {where}", "") for i, m in enumerate(batch.metadata)],
            "reward_names": list(batch.reward_components)}


def _response_row(batch: RolloutBatch, i: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    n = int(batch.response_lengths[i])
    return tuple(batch.response_ids[i, :n].tolist()), tuple(batch.generation_logprobs[i, :n].tolist())


def _messages_entry(log: list[Message], batch: RolloutBatch, i: int) -> list[dict[str, Any]]:
    """The row's messages; the assistant turn that is the response row stores no ids or logprobs (the
    tensors hold them), any other turn stores what it has."""
    out, response = [], _response_row(batch, i)
    for j, m in enumerate(log):
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.flags:
            entry["flags"] = list(m.flags)
        if j == len(log) - 1 and m.role == "assistant" and (m.token_ids, m.generation_logprobs) == response:
            out.append({**entry, "from_response": True})
            continue
        entry["token_ids"] = list(m.token_ids)
        if m.generation_logprobs is not None:
            entry["generation_logprobs"] = list(m.generation_logprobs)
        out.append(entry)
    return out


def _jsonable(value: Any, where: str, path: str) -> Any:
    """``value`` as JSON holds it: numpy values (from Parquet) by ``tolist``; anything else an error naming the key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise BufferFileError(f"{where}: key {path}[{k!r}] is a {type(k).__name__}; JSON keys are strings")
        return {k: _jsonable(v, where, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where, f"{path}[{i}]") for i, v in enumerate(value)]
    if type(value).__module__.split(".")[0] == "numpy" and hasattr(value, "tolist"):
        return _jsonable(value.tolist(), where, path)
    raise BufferFileError(f"{where}: {path or 'the row'} holds a {type(value).__module__}.{type(value).__name__}, "
                          "which JSON cannot hold; the replay buffer is saved as JSON (never pickle): give rows plain "
                          "values (numbers, strings, lists, dicts; numpy values are converted)")


def _message(m: dict[str, Any], batch: RolloutBatch, i: int) -> Message:
    flags = tuple(m.get("flags", ()))
    if m.get("from_response"):
        ids, logprobs = _response_row(batch, i)
        return Message(role=m["role"], content=m["content"], token_ids=ids, generation_logprobs=logprobs, flags=flags)
    logprobs = m.get("generation_logprobs")
    return Message(role=m["role"], content=m["content"], token_ids=tuple(m["token_ids"]),
                   generation_logprobs=tuple(logprobs) if logprobs is not None else None, flags=flags)


def _group_from_entry(entry: dict[str, Any], tensors: dict[str, torch.Tensor], pad_token_id: int) -> BufferedGroup:
    key = f"{entry['ordinal']}/"
    fields = {name: tensors[key + name] for name in _PADDED}
    for optional in ("token_weight_versions", "generated_mask"):
        if key + optional in tensors:
            fields[optional] = tensors[key + optional]
    for name, (width, value) in entry["pads"].items():
        t = fields[name]
        fill = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
        fields[name] = torch.cat([fill, t] if _PADDED.get(name, False) else [t, fill], dim=1)
    rows = {name: tensors.get(key + name) for name in _ROWS}
    token_versions = fields.pop("token_weight_versions", None)
    components = {n: tensors[f"{key}reward/{n}"] for n in entry["reward_names"]}
    batch = RolloutBatch(**fields, **rows, reward_components=components, message_logs=[],
                         metadata=[dict(m) for m in entry["metadata"]], pad_token_id=pad_token_id,
                         weight_version=entry["weight_version"])
    logs = [[_message(m, batch, i) for m in messages] for i, messages in enumerate(entry["messages"])]
    return BufferedGroup(ordinal=entry["ordinal"], target_step=entry["target_step"],
                         weight_version=entry["weight_version"], last_weight_version=entry["last_weight_version"],
                         epoch=entry["epoch"], rollouts=attrs.evolve(batch, message_logs=logs),
                         generation_seconds=entry["generation_seconds"], attempts=entry["attempts"],
                         token_weight_versions=token_versions)
