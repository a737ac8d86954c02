"""Remote calls with deadlines: no silent hangs.

Every call the Ray runtime makes to a worker is awaited through ``gather``, which waits at most
``timeout`` seconds for all of them and turns every way a worker can fail into an exception that
names the worker, the call and the elapsed time:

* a worker that does not answer in time: ``WorkerError("policy worker 1 (pid 1234) did not
  answer train() within 30.0 s")``; the stuck workers are killed (a rank blocked in a collective
  would otherwise wait for its peer forever);
* a worker that died (killed, OOM, segfault, node lost): ``WorkerError("generation worker 0
  (pid 4321) died during generate() after 2.1 s: The actor is dead because ...")``;
* an exception raised by the component itself (bad data, a NaN loss): re-raised on the driver as
  the same exception type, with a note naming the worker, so a run behaves as it does in-process.

On the local runtime, ``EnvironmentDeadline`` gives environment calls the same deadline, so user
code that hangs in process stops the run as a stuck worker does on Ray: ``call_with_deadline`` runs
the call on a daemon thread and abandons it on expiry; ``call_on_main_thread`` (environments that
are ``RunsOnMainThread``, called from the main thread) runs it right there and interrupts it on
expiry. Both raise ``CallTimeout``. An ``async def step`` runs on one event loop of the process
(``environment_loop``), cancelled at its deadline (``await_with_deadline``).

This module imports no Ray at import time (``WorkerError`` is importable anywhere, e.g. by code
that must let it through a broad ``except Exception``).
"""

from __future__ import annotations

import faulthandler
import inspect
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

import attrs

from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.core.multi_turn import DeclaresTools
from grpo_sdk.core.protocols import PromptSampler, RunsOnMainThread, SupportsShutdown


class WorkerError(GrpoSdkError):
    """A remote worker died, or did not answer within its deadline. Exit code 1.

    ``worker`` names it (``"policy worker 1 (pid 1234)"``), ``call`` is the method
    (``"train()"``), ``elapsed`` the seconds waited.
    """

    def __init__(self, message: str, *, worker: str | None = None, call: str | None = None,
                 elapsed: float | None = None):
        super().__init__(message)
        self.worker = worker
        self.call = call
        self.elapsed = elapsed


class CallTimeout(GrpoSdkError):
    """An in-process call into user code (an environment) did not return within its deadline. Exit code 1."""

    def __init__(self, message: str, *, call: str, elapsed: float):
        super().__init__(message)
        self.call = call
        self.elapsed = elapsed


def _has_stderr_fd() -> bool:
    """faulthandler writes to a real file descriptor; a captured stderr (pytest, a notebook) has none."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return False
    return True


# faulthandler has one watchdog per process: with calls on several threads at once (a rollout's
# environment calls, env.max_concurrent_calls), the first to return must not cancel the others'.
# Each call re-arms it (so it fires at most the newest call's backstop after the oldest started
# hanging); the last call out cancels it.
_BACKSTOP_LOCK = threading.Lock()
_BACKSTOP_CALLS = [0]


def _arm_backstop(seconds: float) -> None:
    with _BACKSTOP_LOCK:
        _BACKSTOP_CALLS[0] += 1
        faulthandler.dump_traceback_later(seconds, exit=True)


def _disarm_backstop() -> None:
    with _BACKSTOP_LOCK:
        _BACKSTOP_CALLS[0] -= 1
        if not _BACKSTOP_CALLS[0]:
            faulthandler.cancel_dump_traceback_later()


def call_with_deadline(fn: Callable[..., Any], *args: Any, timeout: float, what: str,
                       deadline_key: str = "cluster.call_timeout_s") -> Any:
    """``fn(*args)`` on a daemon thread, waited for at most ``timeout`` seconds.

    A thread, not a signal: it also bounds code stuck inside a C call (a regex backtracking
    forever, a socket read without a timeout), which no signal handler can interrupt. A call that
    times out is abandoned, still running, on its daemon thread; the run stops, so nothing waits
    for it (a ThreadPoolExecutor would join it at exit and hang there).
    """
    box: dict[str, Any] = {}
    done = threading.Event()
    # Code that hangs inside C while holding the GIL (Python's own regex engine backtracking) keeps
    # this thread from ever waking up, so no Python-level deadline can fire. faulthandler's watchdog
    # is a C thread that needs no GIL: past twice the deadline it prints every thread's stack (where
    # the hang is) and exits with code 1. It is the backstop; the thread deadline below answers first
    # whenever the interpreter can run.
    backstop = _has_stderr_fd()
    if backstop:
        _arm_backstop(2 * timeout + 5)

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=f"grpo-sdk: {what}", daemon=True).start()
    try:
        finished = done.wait(timeout)
    finally:
        if backstop:
            _disarm_backstop()
    if not finished:
        raise CallTimeout(f"{what} did not return within {timeout:g} s ({deadline_key})", call=what,
                          elapsed=timeout)
    if "error" in box:
        raise box["error"]
    return box["value"]


# The signal that interrupts the main thread at a deadline: a real-time one, which nothing in the
# stack uses (SIGALRM is math-verify's own timeout, nested inside the call: its alarm(0) would cancel
# a timer of ours), and which wakes a blocking system call (sleep, a socket read) as a thread cannot.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
INTERRUPT_GRACE_S = 2.0  # past the deadline, how long the interrupted call may take to unwind
_INTERRUPT_EVERY_S = 0.25  # repeated: user code may catch the first interrupt and carry on


class _Overdue(BaseException):
    """Raised into the main thread at its deadline. A BaseException, so user code's ``except
    Exception`` (math-verify's parse has one) lets it through; turned into ``CallTimeout`` below."""


_LOOP: list[Any] = []  # the event loop async environments run on: one per process, made on first use
_LOOP_LOCK = threading.Lock()


def environment_loop() -> Any:
    """The process's event loop for ``async def`` environment methods, on a daemon thread: one loop
    for every call, so a client an environment made in one call (an aiohttp session, an async OpenAI
    client) is on the same loop in the next, and the coroutines of concurrent calls interleave."""
    from grpo_sdk.plugins.toolkit import background_event_loop

    with _LOOP_LOCK:
        if not _LOOP:
            _LOOP.append(background_event_loop("grpo-sdk: environment event loop"))
        return _LOOP[0]


def await_with_deadline(value: Any, *, timeout: float | None, what: str,
                        deadline_key: str = "cluster.call_timeout_s") -> Any:
    """``value``, or, when it is awaitable (what an ``async def step`` returns), its result, awaited
    on ``environment_loop()`` for at most ``timeout`` seconds (None: no limit); on expiry the
    coroutine is cancelled and ``CallTimeout`` raised. Cancelling reaches a coroutine at its next
    ``await``; one that blocks the loop (a ``time.sleep`` inside ``async def``) is abandoned there."""
    if not inspect.isawaitable(value):
        return value
    import asyncio
    import concurrent.futures

    async def result() -> Any:
        return await value

    future = asyncio.run_coroutine_threadsafe(result(), environment_loop())
    backstop = timeout is not None and _has_stderr_fd()
    if backstop:  # a coroutine stuck in native code holding the GIL: nothing else would fire
        _arm_backstop(2 * timeout + 5)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise CallTimeout(f"{what} did not return within {timeout:g} s ({deadline_key})", call=what,
                          elapsed=timeout) from None
    finally:
        if backstop:
            _disarm_backstop()


@attrs.define(eq=False)
class _MainThreadCall:
    frame: Any  # call_on_main_thread's own frame: an interrupt that lands there (not in the call) waits
    overdue: bool = False  # the deadline passed: the handler raises
    finished: threading.Event = attrs.field(factory=threading.Event)  # the call returned or raised
    lock: threading.Lock = attrs.field(factory=threading.Lock)  # a signal is sent only while not finished


_CURRENT: list[_MainThreadCall] = []  # the main thread's call in flight (nested calls: the innermost last)
_PREVIOUS_HANDLER: list[Any] = []  # what INTERRUPT_SIGNAL did before we took it (called when no call is due)


def _on_interrupt(signum: int, frame: Any) -> None:
    call = _CURRENT[-1] if _CURRENT else None
    if call is not None and call.overdue and not call.finished.is_set():
        if frame is not call.frame:  # in our own bookkeeping, the call has returned: let it finish
            raise _Overdue
        return
    previous = _PREVIOUS_HANDLER[0] if _PREVIOUS_HANDLER else None
    if callable(previous):
        previous(signum, frame)


def can_interrupt_this_thread() -> bool:
    """Whether ``call_on_main_thread`` works here: the main thread, on a platform with pthread_kill."""
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill")


def _watch(call: _MainThreadCall, timeout: float, message: str) -> None:
    """At the deadline, interrupt the main thread (again every ``_INTERRUPT_EVERY_S``); past the
    grace, end the process naming the call, as nothing else can stop it."""
    if call.finished.wait(timeout):
        return
    main, give_up = threading.main_thread().ident, time.monotonic() + INTERRUPT_GRACE_S
    while time.monotonic() < give_up:
        with call.lock:
            if call.finished.is_set():
                return
            call.overdue = True
            signal.pthread_kill(main, INTERRUPT_SIGNAL)
        if call.finished.wait(min(_INTERRUPT_EVERY_S, max(0.0, give_up - time.monotonic()))):
            return
    sys.stderr.write(f"grpo-sdk: {message}, and cannot be interrupted (it is inside native code that ignores "
                     "signals); the process exits with code 1. Where each thread is:\n")
    sys.stderr.flush()
    if _has_stderr_fd():
        faulthandler.dump_traceback(all_threads=True)
    os._exit(1)


def call_on_main_thread(fn: Callable[..., Any], *args: Any, timeout: float, what: str,
                        deadline_key: str = "cluster.call_timeout_s") -> Any:
    """``fn(*args)`` on this thread, the main one, stopped at ``timeout`` seconds with ``CallTimeout``.

    For calls that need the main thread (signal-based timeouts). At the deadline a watchdog thread
    sends the main thread ``INTERRUPT_SIGNAL``, whose handler raises: that stops Python code and
    wakes a blocking system call. Code that cannot be interrupted is ended with the process, naming
    the call: native code that ignores signals (the watchdog prints where each thread is and exits
    with code 1 after ``INTERRUPT_GRACE_S``), or native code that holds the GIL, so no Python runs
    (faulthandler's C watchdog, as in ``call_with_deadline``, a few seconds later).
    """
    if not can_interrupt_this_thread():
        raise RuntimeError("call_on_main_thread() is for the main thread; use call_with_deadline()")
    if not _PREVIOUS_HANDLER:  # installed once and left in place: a late signal then never meets SIG_DFL
        _PREVIOUS_HANDLER.append(signal.signal(INTERRUPT_SIGNAL, _on_interrupt))
    call = _MainThreadCall(frame=sys._getframe())
    message = f"{what} did not return within {timeout:g} s ({deadline_key})"
    backstop = _has_stderr_fd()
    if backstop:  # native code holding the GIL: neither the handler nor the watchdog can run
        faulthandler.dump_traceback_later(timeout + INTERRUPT_GRACE_S + 3, exit=True)
    _CURRENT.append(call)
    threading.Thread(target=_watch, args=(call, timeout, message), name=f"grpo-sdk: deadline of {what}",
                     daemon=True).start()
    def run() -> Any:  # a frame of its own: a builtin fn blocking in a system call is interrupted too
        return fn(*args)

    try:
        return run()
    except _Overdue:
        raise CallTimeout(message, call=what, elapsed=timeout) from None
    finally:
        with call.lock:
            call.finished.set()
        _CURRENT.remove(call)
        if backstop:
            faulthandler.cancel_dump_traceback_later()


class EnvironmentDeadline:
    """An in-process environment whose ``step`` and ``sample_prompts`` have a deadline; every other
    attribute is the environment's own. It has the optional methods the environment has, and only
    those (``PromptSampler``, ``SupportsShutdown``, ``DeclaresTools``), so ``isinstance`` answers as
    for the environment (Python 3.12+ looks protocol members up statically, past ``__getattr__``)."""

    def __init__(self, environment: Any, name: str, timeout: float):
        self.component = environment  # the environment itself (for code that must know its class)
        self._name, self._timeout = name, timeout
        self._main_thread = isinstance(environment, RunsOnMainThread) and bool(environment.runs_on_main_thread())
        if isinstance(environment, PromptSampler):
            self.sample_prompts = self._sample_prompts
        if isinstance(environment, SupportsShutdown):
            self.shutdown = environment.shutdown
        if isinstance(environment, DeclaresTools):
            self.tool_schemas = environment.tool_schemas
        if isinstance(environment, RunsOnMainThread):  # the rollout then keeps its calls in its own thread
            self.runs_on_main_thread = environment.runs_on_main_thread

    def step(self, message_logs: Any, metadata: Any) -> Any:
        what = f"environment {self._name!r} step() on {len(message_logs)} samples"
        if inspect.iscoroutinefunction(self.component.step):  # no thread: the coroutine runs on the loop
            return await_with_deadline(self.component.step(message_logs, metadata), timeout=self._timeout, what=what)
        # On the main thread when the environment needs it and the loop runs there; elsewhere (the
        # asynchronous loop's collector thread) on a helper thread, as every other environment.
        call = call_on_main_thread if self._main_thread and can_interrupt_this_thread() else call_with_deadline
        started = time.monotonic()
        ret = call(self.component.step, message_logs, metadata, timeout=self._timeout, what=what)
        # A plain def that returns an awaitable gets what is left of the deadline
        return await_with_deadline(ret, timeout=max(0.0, self._timeout - (time.monotonic() - started)), what=what)

    def _sample_prompts(self, num_prompts: int, rng: Any) -> Any:
        return call_with_deadline(self.component.sample_prompts, num_prompts, rng, timeout=self._timeout,
                                  what=f"environment {self._name!r} sample_prompts()")

    def __getattr__(self, item: str) -> Any:
        return getattr(self.component, item)


@attrs.define(eq=False)
class WorkerHandle:
    """One Ray actor and how errors name it."""

    actor: Any
    role: str  # "policy", "generation", "environment", "teacher"
    index: int  # rank or replica index
    pid: int | None = None
    node: str | None = None  # the node's address
    node_id: str | None = None  # Ray's id of the node: nodes on one machine share an address
    show_node: bool = False  # multi-node clusters: say which node

    @property
    def label(self) -> str:
        where = f"pid {self.pid}" if self.pid is not None else "not started"
        if self.show_node and self.node:
            where += f" on {self.node}" + (f" node {self.node_id[:8]}" if self.node_id else "")
        return f"{self.role} worker {self.index} ({where})"

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead, or the cluster is gone: nothing left to stop
            pass


@attrs.define(eq=False)
class Call:
    """One remote call in flight: which worker, which method, its object ref."""

    worker: WorkerHandle
    method: str
    ref: Any


def _reason(exc: BaseException) -> str:
    """The informative line of a Ray system error ("The actor is dead because ..."), shortened."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "dead because" in line or "killed" in line.lower() or "out of memory" in line.lower():
            return line[:400]
    return (lines[0] if lines else type(exc).__name__)[:400]


# How long a rank's collective error (torch.distributed raises RuntimeErrors: "Connection closed by
# peer") waits for Ray to report a peer lost: a lost node's actors are reported dead only once the GCS
# has missed its health checks (Ray's defaults: every 3 s, 5 missed), after its peers' connections broke.
PEER_NOTICE_S = 30.0


def _lost_peer(pending: list[Any], by_ref: dict[Any, Call], grace: float, since: float) -> WorkerError | None:
    """The ``WorkerError`` of a pending call whose worker Ray reports lost within ``grace`` seconds,
    or None: a rank's error may be the echo of a peer that died, and the peer is the cause to name."""
    import ray
    from ray.exceptions import RayError, RayTaskError

    start = time.monotonic()
    waiting = list(pending)
    while waiting and (left := start + grace - time.monotonic()) > 0:
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except RayTaskError:  # another echo
                continue
            except RayError as exc:
                call, elapsed = by_ref[ref], time.monotonic() - since
                return WorkerError(f"{call.worker.label} died during {call.method}() after {elapsed:.1f} s: "
                                   f"{_reason(exc)}", worker=call.worker.label, call=f"{call.method}()",
                                   elapsed=elapsed)
    return None


def gather(calls: Sequence[Call], *, timeout: float, on_app_error: str = "wait",
           on_failure: Callable[[WorkerError], None] | None = None,
           deadline_key: str = "cluster.call_timeout_s") -> list[Any]:
    """The results of ``calls`` in order, waiting at most ``timeout`` seconds for all of them.

    ``on_app_error``: when a component raises, ``"wait"`` lets the other calls finish (replicas
    and environment actors are independent) before re-raising; ``"kill"`` kills the workers still
    running (ranks of one torch.distributed group would block in a collective waiting for the one
    that raised), after up to ``PEER_NOTICE_S`` for Ray to report one of them lost when the error
    is a RuntimeError (a collective's, perhaps from a lost peer: the lost worker is then named
    instead). ``on_failure`` is told of every WorkerError before it is raised (the runtime
    refuses later calls once a worker is lost). ``deadline_key`` is the setting a timeout names.
    """
    import ray
    from ray.exceptions import RayError, RayTaskError

    start = time.monotonic()
    by_ref = {call.ref: call for call in calls}
    pending = [call.ref for call in calls]
    results: dict[Any, Any] = {}
    app_error: BaseException | None = None

    def fail(error: WorkerError) -> None:
        for ref in pending:
            by_ref[ref].worker.kill()
        if on_failure is not None:
            on_failure(error)
        raise error

    while pending:
        left = start + timeout - time.monotonic()
        if left <= 0:
            stuck = [by_ref[ref] for ref in pending]
            first = stuck[0]
            others = f" (nor did {', '.join(c.worker.label for c in stuck[1:])})" if len(stuck) > 1 else ""
            fail(WorkerError(f"{first.worker.label} did not answer {first.method}() within {timeout:.1f} s "
                             f"({deadline_key}){others}; stopped {'them' if others else 'it'}",
                             worker=first.worker.label, call=f"{first.method}()", elapsed=time.monotonic() - start))
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            call = by_ref[ref]
            try:
                results[ref] = ray.get(ref)
            except RayTaskError as exc:  # the component raised: an application error, not a lost worker
                cause = exc.cause if isinstance(getattr(exc, "cause", None), Exception) else None
                if cause is None:
                    cause = WorkerError(f"{call.worker.label} raised during {call.method}(): {_reason(exc)}",
                                        worker=call.worker.label, call=f"{call.method}()",
                                        elapsed=time.monotonic() - start)
                else:
                    cause.add_note(f"raised in {call.worker.label} during {call.method}(); remote traceback:\n"
                                   f"{getattr(exc, 'traceback_str', '')}")
                if on_app_error == "kill":
                    if pending and isinstance(cause, RuntimeError):
                        grace = min(PEER_NOTICE_S, start + timeout - time.monotonic())
                        lost = _lost_peer(pending, by_ref, grace, start)
                        if lost is not None:
                            first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
                            lost.add_note(f"{call.worker.label} noticed first, during {call.method}(): {first_line}")
                            fail(lost)
                    for other in pending:
                        by_ref[other].worker.kill()
                    raise cause from None
                app_error = app_error or cause
            except RayError as exc:  # died: killed, OOM-killed, crashed, node lost
                elapsed = time.monotonic() - start
                fail(WorkerError(f"{call.worker.label} died during {call.method}() after {elapsed:.1f} s: "
                                 f"{_reason(exc)}", worker=call.worker.label, call=f"{call.method}()",
                                 elapsed=elapsed))
    if app_error is not None:
        raise app_error
    return [results[call.ref] for call in calls]
