"""One thread between many concurrent requests and one generation backend.

Requests arrive from the HTTP server's threads; the engine is the only caller of the backend
while it runs. A backend with ``submit``/``poll`` (``AsyncGeneration``: vLLM's async engine) gets
every request as it comes (continuous batching). Any other backend (hf, a third party's) gets
batches: the engine takes the requests that arrive within ``batch_wait_s`` of each other (up to
``max_batch_wait_s`` after the first), groups them by
sampling parameters and calls ``generate`` once per group, so 128 agents talking at once cost a
few batched calls, not 128.

Bounded everywhere: a full queue refuses at once (``EngineBusy``, HTTP 429), a request past its
deadline is answered ``DeadlineExceeded`` (HTTP 504) and never generated after, and a backend
error fails the requests of that call (HTTP 500) while the engine goes on with the next.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any, Sequence

import attrs

from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.core.records import GenerationInput, SamplingParams


class EngineBusy(GrpoSdkError):
    """The request queue is full."""


class EngineClosed(GrpoSdkError):
    """The engine is not serving (between rollout collections, or stopped)."""


class DeadlineExceeded(GrpoSdkError):
    """The request was not answered within its deadline."""


@attrs.frozen(kw_only=True)
class Sampled:
    """One request's generation."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    truncated: bool  # ended at max_new_tokens without a stop token


@attrs.define(eq=False)
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    deadline: float
    done: threading.Event = attrs.field(factory=threading.Event)
    result: Sampled | None = None
    error: BaseException | None = None

    def finish(self, result: Sampled | None = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    from grpo_sdk.plugins.tensors import left_pad as pad  # torch: the engine runs only where generation does

    return pad(rows, pad_id)


def _rows(out: Any) -> list[Sampled]:
    lengths = out.response_lengths.tolist()
    ids, logprobs = out.response_ids.tolist(), out.logprobs.tolist()
    versions = out.token_weight_versions.tolist() if out.token_weight_versions is not None else None
    truncated = out.truncated.tolist()
    return [Sampled(ids=ids[i][:n], logprobs=logprobs[i][:n],
                    versions=versions[i][:n] if versions is not None else [int(out.weight_version)] * n,
                    truncated=bool(truncated[i])) for i, n in enumerate(lengths)]


class GenerationEngine:
    """Example::

        engine = GenerationEngine(generation, pad_token_id=0)
        engine.start()
        sampled = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8), timeout_s=30)
        engine.stop()
    """

    def __init__(self, generation: Any, *, pad_token_id: int, max_batch: int = 256, max_queue: int = 1024,
                 batch_wait_s: float = 0.005, max_batch_wait_s: float = 0.05):
        self.generation = generation
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max_batch_wait_s
        self.streaming = all(hasattr(generation, m) for m in ("submit", "poll", "cancel"))
        self._queue: queue.Queue[_Request] = queue.Queue(maxsize=max_queue)
        self._open = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.served = 0

    # --- the callers' side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="grpo-endpoint-engine", daemon=True)
        self._thread.start()
        self._open.set()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        """Refuse new requests (``EngineClosed``); queued ones are still answered."""
        self._open.clear()

    @property
    def is_open(self) -> bool:
        return self._open.is_set() and not self._stopping.is_set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._open.clear()
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._fail_queued(EngineClosed("the endpoint is shutting down"))

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, *, timeout_s: float) -> Sampled:
        """Sample one response to ``prompt_ids``; blocks until it is done or ``timeout_s`` passed."""
        if not self.is_open:
            raise EngineClosed("the endpoint is not serving now (the trainer is between rollout collections)")
        request = _Request(list(prompt_ids), sampling, time.monotonic() + timeout_s)
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            raise EngineBusy(f"the request queue is full ({self._queue.maxsize} waiting); retry later") from None
        if not request.done.wait(timeout_s + 1.0):  # the engine answers expired requests itself; this is the backstop
            raise DeadlineExceeded(f"no answer within the request's deadline of {timeout_s:g} s")
        if request.error is not None:
            raise request.error
        return request.result

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    # --- the engine's thread --------------------------------------------------------------------

    def _run(self) -> None:
        pending: dict[str, _Request] = {}
        while not self._stopping.is_set():
            batch = self._collect(block=not pending)
            if self.streaming:
                self._stream(batch, pending)
            else:
                self._batched(batch)
        if pending:
            self.generation.cancel(list(pending))
            for request in pending.values():
                request.finish(error=EngineClosed("the endpoint is shutting down"))

    def _collect(self, block: bool) -> list[_Request]:
        batch: list[_Request] = []
        try:
            batch.append(self._queue.get(timeout=0.05) if block else self._queue.get_nowait())
        except queue.Empty:
            return batch
        # A sliding window: while requests keep arriving within batch_wait_s of each other the batch
        # grows, up to max_batch_wait_s after the first (agents' requests trickle in over milliseconds).
        gap = self.batch_wait_s if not self.streaming else 0.0
        start = time.monotonic()
        while len(batch) < self.max_batch:
            now = time.monotonic()
            try:
                batch.append(self._queue.get(timeout=max(0.0, min(now + gap, start + self.max_batch_wait_s) - now)))
            except queue.Empty:
                break
        now = time.monotonic()
        live = []
        for request in batch:
            if request.deadline <= now:
                request.finish(error=DeadlineExceeded("the request's deadline passed while it waited in the queue"))
            else:
                live.append(request)
        return live

    def _batched(self, batch: list[_Request]) -> None:
        groups: dict[SamplingParams, list[_Request]] = {}
        for request in batch:
            groups.setdefault(request.sampling, []).append(request)
        for sampling, requests in groups.items():
            try:
                input_ids, attention_mask = left_pad([r.prompt_ids for r in requests], self.pad_token_id)
                out = self.generation.generate(GenerationInput(input_ids=input_ids, attention_mask=attention_mask),
                                               sampling)
                for request, row in zip(requests, _rows(out)):
                    request.finish(result=row)
                self.served += len(requests)
            except BaseException as exc:  # noqa: BLE001 - the callers raise it; the engine serves the next batch
                for request in requests:
                    request.finish(error=exc)

    def _stream(self, batch: list[_Request], pending: dict[str, _Request]) -> None:
        for request in batch:
            request_id = f"endpoint-{next(self._ids)}"
            input_ids, attention_mask = left_pad([request.prompt_ids], self.pad_token_id)
            try:
                self.generation.submit(request_id, GenerationInput(input_ids=input_ids, attention_mask=attention_mask),
                                       request.sampling)
                pending[request_id] = request
            except BaseException as exc:  # noqa: BLE001
                request.finish(error=exc)
        if not pending:
            return
        for request_id, result in self.generation.poll(0.02):
            request = pending.pop(request_id, None)
            if request is None:
                continue
            if isinstance(result, BaseException):
                request.finish(error=result)
            else:
                request.finish(result=_rows(result)[0])
                self.served += 1
        now = time.monotonic()
        expired = [rid for rid, r in pending.items() if r.deadline <= now]
        if expired:
            self.generation.cancel(expired)
            for rid in expired:
                pending.pop(rid).finish(error=DeadlineExceeded("the request's deadline passed while it was generated"))

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                self._queue.get_nowait().finish(error=error)
            except queue.Empty:
                return
