"""What lets a rollout stream: requests to a generation backend, and bounded environment calls.

``BatchedGeneration`` gives a backend that only has ``generate`` the ``AsyncGeneration`` methods the
rollout drives (``submit``/``poll``/``cancel``): ``poll`` runs one ``generate`` over every request
waiting. It is the production path of every backend that is not a continuous-batching engine, so
``rollouts.episodes`` has one loop for both.

``Scorer`` makes the ``Environment.step`` calls of a rollout, one per group (the episodes of one
prompt), at most ``env.max_concurrent_calls`` at once on a thread pool, so a group is scored while
other groups still decode or are scored. ``env.max_concurrent_calls=0`` keeps one call for every
episode of a turn, in the caller's thread (what a reward model batching on a GPU wants); so does
an environment that must run on the main thread (``RunsOnMainThread``). Each call is read by
``step_environment``: failures attributed to samples, ``env.on_reward_error``, a deadline that
names the sample.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from concurrent.futures import Future
from typing import Any, Sequence

import attrs
import torch

from grpo_sdk.core.optional_protocols import AsyncGeneration, RunsOnMainThread
from grpo_sdk.core.records import GenerationInput, GenerationOutput, SamplingParams
from grpo_sdk.rollouts.environment_step import TurnResult, step_environment


def row_seed(base: int, group: int, sample: int, turn: int) -> int:
    """A row's sampling seed (``GenerationInput.seeds``): a function of the run's seed (validation:
    ``SamplingParams.seed``), the global group index, the sample in the group and the turn, so its
    tokens do not depend on which rows share its batch or on when it was admitted."""
    digest = hashlib.blake2b(f"{base}/{group}/{sample}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class BatchedGeneration:
    """``submit``/``poll``/``cancel`` over a backend's ``generate``: ``poll`` generates every waiting
    request in one call per distinct sampling (rows in request-id order, so a batch is the same
    whatever order its requests came in, and a backend that draws from its own RNG stays
    reproducible) and returns them all."""

    def __init__(self, generation: Any, pad_token_id: int):
        self.generation, self.pad_token_id = generation, pad_token_id
        self.waiting: dict[str, tuple[GenerationInput, SamplingParams]] = {}

    def submit(self, request_id: str, prompts: GenerationInput, sampling: SamplingParams) -> None:
        self.waiting[request_id] = (prompts, sampling)

    def cancel(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)

    def poll(self, timeout_s: float) -> list[tuple[str, GenerationOutput | BaseException]]:
        buckets: dict[SamplingParams, list[str]] = {}
        for request_id in sorted(self.waiting):  # the same sampling up to max_new_tokens: one call
            buckets.setdefault(attrs.evolve(self.waiting[request_id][1], max_new_tokens=1), []).append(request_id)
        out: list[tuple[str, GenerationOutput | BaseException]] = []
        for key, ids in buckets.items():
            requests = [self.waiting.pop(i) for i in ids]
            new_tokens = max(s.max_new_tokens for _, s in requests)
            merged = _merge([p for p, _ in requests], [s.max_new_tokens for _, s in requests], self.pad_token_id)
            result = self.generation.generate(merged, attrs.evolve(key, max_new_tokens=new_tokens))
            start = 0
            for request_id, (prompts, _) in zip(ids, requests):
                rows = int(prompts.input_ids.shape[0])
                out.append((request_id, _rows(result, start, start + rows)))
                start += rows
        return out


def _merge(inputs: list[GenerationInput], budgets: list[int], pad_id: int) -> GenerationInput:
    """One left-padded batch of several requests' rows, each row keeping its budget and seed."""
    width = max(int(p.input_ids.shape[1]) for p in inputs)

    def left(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    rows = [p.max_new_tokens if p.max_new_tokens is not None else torch.full((p.input_ids.shape[0],), b)
            for p, b in zip(inputs, budgets)]
    seeds = None if any(p.seeds is None for p in inputs) else torch.cat([p.seeds for p in inputs])
    return GenerationInput(input_ids=torch.cat([left(p.input_ids, pad_id) for p in inputs]),
                           attention_mask=torch.cat([left(p.attention_mask, 0) for p in inputs]),
                           max_new_tokens=torch.cat(rows).long(), seeds=seeds)


def _rows(out: GenerationOutput, start: int, stop: int) -> GenerationOutput:
    versions = out.token_weight_versions
    return attrs.evolve(out, response_ids=out.response_ids[start:stop], response_lengths=out.response_lengths[start:stop],
                        logprobs=out.logprobs[start:stop], truncated=out.truncated[start:stop],
                        token_weight_versions=versions[start:stop] if versions is not None else None)


def as_async(generation: Any, pad_token_id: int) -> tuple[Any, bool]:
    """The generation as ``submit``/``poll``/``cancel``, and whether it streams on its own (an
    ``AsyncGeneration``; else ``BatchedGeneration``, which generates only when polled)."""
    if isinstance(generation, AsyncGeneration):
        return generation, True
    return BatchedGeneration(generation, pad_token_id), False


@attrs.define(eq=False)
class Scored:
    """One environment call's answer: a result per episode, the components it named and its metrics."""

    results: list[TurnResult]
    names: list[str]
    metrics: dict[str, float]
    samples: int  # the call's: its metrics are weighted by them


class _DaemonPool:
    """At most ``workers`` calls at once on daemon threads. Not a ThreadPoolExecutor: that one joins
    its threads at exit, so after an interrupt the process would wait for every environment call
    still out (up to ``cluster.call_timeout_s`` each)."""

    def __init__(self, workers: int, name: str):
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.futures: list[Future] = []
        self.workers = workers
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name} {i}", daemon=True).start()

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        self.futures.append(future)
        self.tasks.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (task := self.tasks.get()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the rollout's thread
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Calls not started never start; a call running ends on its own (its deadline bounds it)."""
        for future in self.futures:
            future.cancel()
        for _ in range(self.workers):
            self.tasks.put(None)


class Scorer:
    """``Environment.step`` calls, at most ``max_concurrent_calls`` at once (0: none in parallel; the
    rollout then makes one call per turn, in its own thread)."""

    def __init__(self, environment: Any, env_name: str, on_error: str, max_concurrent_calls: int):
        self.environment, self.env_name, self.on_error = environment, env_name, on_error
        main_thread = isinstance(environment, RunsOnMainThread) and bool(environment.runs_on_main_thread())
        self.pool = (_DaemonPool(max_concurrent_calls, "grpo-sdk: environment step")
                     if max_concurrent_calls > 0 and not main_thread else None)

    @property
    def per_group(self) -> bool:
        return self.pool is not None

    def score(self, logs: list[Any], metadata: list[Any], sources: list[str]) -> Scored:
        results, names, metrics = step_environment(self.environment, self.env_name, logs, metadata, sources,
                                                   self.on_error)
        # A call whose every sample failed names no component of its own ("reward" stands in)
        return Scored(results, names if any(r.failure is None for r in results) else [], metrics, len(logs))

    def submit(self, logs: list[Any], metadata: list[Any], sources: list[str]) -> Future:
        assert self.pool is not None
        return self.pool.submit(self.score, logs, metadata, sources)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
