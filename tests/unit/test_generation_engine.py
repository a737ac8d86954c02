"""The endpoint's generation engine on its own: batching for ``generate`` backends, request by
request for ``submit``/``poll`` backends, deadlines and shutdown.

The backends here are fakes (named so): they return fixed tokens, so the tests check only how the
engine schedules calls, not sampling; tests/e2e/test_rollout_endpoint.py and the vLLM lane's
tests/environments/test_vllm_endpoint.py drive real backends.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from grpo_sdk.core.records import GenerationOutput, SamplingParams
from grpo_sdk.serving.engine import DeadlineExceeded, EngineClosed, GenerationEngine


def output(rows: int, tokens: list[int], version: int = 0) -> GenerationOutput:
    ids = torch.tensor([tokens] * rows)
    return GenerationOutput(response_ids=ids, response_lengths=torch.full((rows,), len(tokens)),
                            logprobs=torch.full(ids.shape, -0.5), truncated=torch.zeros(rows, dtype=torch.bool),
                            weight_version=version)


class FakeBatchedBackend:
    """A fake ``generate`` backend: answers each row with its last prompt token + 1, records the calls."""

    def __init__(self):
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(self, prompts, sampling):
        self.calls.append((prompts.input_ids.shape[0], sampling))
        time.sleep(0.05)
        last = prompts.input_ids[:, -1].tolist()
        out = output(len(last), [0], version=7)
        return GenerationOutput(response_ids=torch.tensor([[t + 1] for t in last]), response_lengths=out.response_lengths,
                                logprobs=out.logprobs, truncated=out.truncated, weight_version=7)


class FakeStreamingBackend:
    """A fake ``AsyncGeneration`` backend: a request finishes ``delay`` seconds after it was submitted."""

    def __init__(self, delay: float):
        self.delay = delay
        self.pending: dict[str, float] = {}
        self.cancelled: list[str] = []
        self.lock = threading.Lock()

    def generate(self, prompts, sampling):
        raise AssertionError("a streaming backend is driven through submit/poll")

    def submit(self, request_id, prompts, sampling):
        with self.lock:
            self.pending[request_id] = time.monotonic() + self.delay

    def poll(self, timeout_s):
        time.sleep(min(timeout_s, 0.01))
        now = time.monotonic()
        with self.lock:
            done = [rid for rid, at in self.pending.items() if at <= now]
            for rid in done:
                del self.pending[rid]
        return [(rid, output(1, [5, 6], version=3)) for rid in done]

    def cancel(self, request_ids):
        with self.lock:
            for rid in request_ids:
                self.pending.pop(rid, None)
                self.cancelled.append(rid)


def run_concurrently(engine, prompts, sampling, timeout_s=10.0):
    results: list = [None] * len(prompts)

    def one(i):
        try:
            results[i] = engine.generate(prompts[i], sampling[i] if isinstance(sampling, list) else sampling,
                                         timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_concurrent_requests_are_batched_by_sampling_parameters():
    backend = FakeBatchedBackend()
    engine = GenerationEngine(backend, pad_token_id=0, batch_wait_s=0.2)
    engine.start()
    try:
        greedy, hot = SamplingParams(max_new_tokens=1, temperature=0.5), SamplingParams(max_new_tokens=1)
        results = run_concurrently(engine, [[1, i] for i in range(8)], [greedy] * 4 + [hot] * 4)
    finally:
        engine.stop()
    assert [r.ids for r in results] == [[i + 1] for i in range(8)]  # each row its own answer, in order
    assert all(r.versions == [7] and not r.truncated for r in results)
    assert sorted(n for n, _ in backend.calls) == [4, 4] and {s for _, s in backend.calls} == {greedy, hot}


def test_a_streaming_backend_gets_each_request_and_expired_ones_are_cancelled():
    backend = FakeStreamingBackend(delay=0.05)
    engine = GenerationEngine(backend, pad_token_id=0)
    engine.start()
    try:
        results = run_concurrently(engine, [[1, 2]] * 5, SamplingParams(max_new_tokens=2))
        assert all(r.ids == [5, 6] and r.versions == [3, 3] for r in results)
        backend.delay = 60.0
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            engine.generate([1], SamplingParams(max_new_tokens=2), timeout_s=0.3)
        assert time.monotonic() - start < 5 and len(backend.cancelled) == 1
        threading.Timer(0.3, engine.stop).start()
        start = time.monotonic()
        stuck = run_concurrently(engine, [[1]], SamplingParams(max_new_tokens=2), timeout_s=30)
        assert time.monotonic() - start < 10
    finally:
        engine.stop()
    assert isinstance(stuck[0], EngineClosed)  # a request in flight at shutdown is answered, not left waiting


def test_a_closed_engine_refuses_and_reopens():
    engine = GenerationEngine(FakeBatchedBackend(), pad_token_id=0)
    engine.start()
    try:
        engine.close()
        with pytest.raises(EngineClosed, match="not serving"):
            engine.generate([1], SamplingParams(max_new_tokens=1), timeout_s=1)
        engine.open()
        assert engine.generate([1], SamplingParams(max_new_tokens=1), timeout_s=5).ids == [2]
    finally:
        engine.stop()
