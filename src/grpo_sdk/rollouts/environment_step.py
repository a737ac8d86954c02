"""One call of ``Environment.step`` on a batch, read sample by sample.

What a sample's answer can be: rewards (a number per component, or None for "no reward" this
turn), a failure (an exception, a non-finite reward), and for multi-turn episodes a done flag,
the observation messages that continue it, its next metadata and the flags on the turn just
scored. ``env.on_reward_error`` decides what a failure does: ``raise`` stops the run naming the
sample, ``mask`` keeps it as the sample's failure (it leaves the loss and the baseline).

If the batched call raises, or returns something malformed, each sample is stepped alone to find
which ones fail, so the error (or the masking) names the sample instead of the whole batch. A
multi-turn environment is therefore stepped twice on those samples: ``step`` must be a function
of the message log and metadata it is given (state lives in the metadata).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs

from grpo_sdk.core.errors import EnvironmentStepError
from grpo_sdk.core.records import EnvironmentReturn, Message
from grpo_sdk.runtime.deadlines import CallTimeout, WorkerError


class RewardFailure(Exception):
    pass


@attrs.frozen(kw_only=True)
class TurnResult:
    """One sample's answer to one ``Environment.step`` call."""

    rewards: dict[str, float | None] = attrs.field(factory=dict)  # None: no reward from this component this turn
    failure: BaseException | None = None  # kept with env.on_reward_error=mask; the sample leaves the loss
    done: bool = True
    observation: tuple[Message, ...] = ()  # what continues the episode (done=False)
    metadata: dict[str, Any] | None = None  # the sample's metadata for its next turn; None: unchanged
    flags: tuple[str, ...] = ()  # recorded on the assistant turn just scored


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def prompt_message(log: Sequence[Message]) -> Message:
    """The message the episode answers: the last non-assistant message before the first generated
    turn (``log[0]`` of a plain prompt's ``[user, assistant, ...]``; the last user turn of a
    conversational prompt)."""
    first = next((i for i, m in enumerate(log) if m.generation_logprobs is not None), len(log) - 1)
    for message in reversed(log[:first]):
        if message.role != "assistant":
            return message
    return log[0]


def _as_reward(value: Any) -> float | None:
    """A reward as a float, or None when it is not a finite real number (None, text, NaN, a many-element tensor)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _per_sample(ret: EnvironmentReturn, field: str, size: int) -> list[Any] | None:
    values = getattr(ret, field)
    if values is not None and len(values) != size:
        raise RewardFailure(f"{field} has {len(values)} entries for {size} samples")
    return values


def _observation(value: Any) -> tuple[Message, ...]:
    if value is None:
        return ()
    messages = (value,) if isinstance(value, Message) else tuple(value) if isinstance(value, (list, tuple)) else None
    if messages is None or not all(isinstance(m, Message) for m in messages):
        raise RewardFailure(f"an observation is {type(value).__name__}, not a Message, a list of them or None")
    return messages


def _read(ret: Any, size: int) -> list[TurnResult]:
    """The samples' answers in a return; a malformed return raises RewardFailure for the whole call."""
    if not isinstance(ret, EnvironmentReturn) or not ret.rewards:
        raise RewardFailure(f"step() returned {type(ret).__name__}, not an EnvironmentReturn with rewards")
    for name, values in ret.rewards.items():
        if len(values) != size:
            raise RewardFailure(f"reward {name!r} has {len(values)} values for {size} samples")
    done, observations, metadata, flags = (_per_sample(ret, f, size) for f in ("done", "observations", "metadata",
                                                                             "flags"))
    out = []
    for i in range(size):
        if metadata is not None and not isinstance(metadata[i], dict):
            raise RewardFailure(f"metadata[{i}] is {type(metadata[i]).__name__}, not a dict")
        out.append(TurnResult(
            rewards={name: values[i] for name, values in ret.rewards.items()},
            done=True if done is None else bool(done[i]),
            observation=_observation(observations[i]) if observations is not None else (),
            metadata=metadata[i] if metadata is not None else None,
            flags=tuple(str(f) for f in flags[i]) if flags is not None and flags[i] else ()))
    return out


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


def step_environment(environment: Any, env_name: str, logs: list[list[Message]], metadata: list[dict[str, Any]],
                     sources: list[str], on_error: str) -> tuple[list[TurnResult], list[str], dict[str, float]]:
    """Each sample's ``TurnResult``, the reward components' names (sorted) and the call's metrics."""
    size = len(logs)

    def describe(i: int) -> str:
        return (f"sample {i} ({sources[i]}, prompt {_short(prompt_message(logs[i]).content)}, "
                f"response {_short(logs[i][-1].content)})")

    try:
        ret = environment.step(logs, metadata)
        results, metrics = _read(ret, size), _check_metrics(ret.metrics, env_name)
        names = sorted(ret.rewards)
    except WorkerError:
        raise  # a lost or stuck worker says nothing about the samples: never retried, never masked
    except EnvironmentStepError:
        raise
    except Exception as batch_error:  # noqa: BLE001 - attribute the failure (or the hang) to samples
        results, names, metrics = [], [], {}
        for i in range(size):
            try:
                single = environment.step([logs[i]], [metadata[i]])
                results.append(_read(single, 1)[0])
                names = names or sorted(single.rewards)
            except WorkerError:
                raise
            except CallTimeout as exc:  # a hang is not a bad reward: stop, naming the sample, whatever on_error says
                raise EnvironmentStepError(f"environment {env_name!r} did not return a reward for {describe(i)} "
                                           f"within {exc.elapsed:g} s (cluster.call_timeout_s); the run stops "
                                           "rather than wait forever") from exc
            except Exception as exc:  # noqa: BLE001
                results.append(TurnResult(failure=exc))
        if all(r.failure is None for r in results):
            raise EnvironmentStepError(f"environment {env_name!r} failed on the batch but on no single sample: "
                                       f"{type(batch_error).__name__}: {batch_error}") from batch_error
        names = names or ["reward"]

    out = []
    for i, result in enumerate(results):
        failure = result.failure or next(
            (RewardFailure(f"reward {n!r} is {v!r}, not a finite number") for n, v in result.rewards.items()
             if v is not None and _as_reward(v) is None), None)
        if failure is not None and on_error == "raise":
            raise EnvironmentStepError(
                f"environment {env_name!r} failed on {describe(i)}: {type(failure).__name__}: {failure} "
                "(env.on_reward_error=mask drops such samples from the loss instead)") from failure
        if failure is not None:
            out.append(TurnResult(failure=failure))
        else:
            out.append(attrs.evolve(result, rewards={n: _as_reward(v) for n, v in result.rewards.items()}))
    return out, names, metrics
