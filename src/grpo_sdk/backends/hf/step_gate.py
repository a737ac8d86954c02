"""Who may run a forward pass of the hf sampler, who may swap its weights, and pauses for a refit.

``HFGeneration.update_weights`` copies new weights in place into the tensors the sampler's forward
passes read, so a copy must never overlap a forward (a torn forward would sample from half old,
half new weights). Forwards are readers (several ``generate`` threads may decode at once), a weight
update is a writer. A waiting update is let in at the next step boundary: without that, a Python
lock's unfair hand-over could let a decoding loop take the lock back step after step, and the
update would wait for the whole generation instead of at most one decode step.

The pause of ``PausesForRefit`` lives here too: while paused, a new ``generate`` call waits for
``resume`` (``keep_in_flight=False`` also waits until the running calls end), and a request in flight
across an update made during a ``keep_in_flight=True`` pause waits at its next step for ``resume``,
which says whether it recomputes its KV cache. Every wait has a deadline (``timeout_s``, the run's
``cluster.call_timeout_s``): a missing resume is a clear error, never a hang.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from grpo_sdk.plugins import GrpoSdkError


class StepGate:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._forwards = 0  # forward passes running now
        self._updates_waiting = 0  # update_weights calls waiting for (or doing) their copy
        self._running = 0  # generate calls admitted and not yet returned
        self._paused = False
        self._keep_in_flight = False
        self.recompute_kv_cache = False  # what the last resume asked of requests in flight across an update

    def _wait(self, ready: Callable[[], bool], what: str,
              fix: str = "every pause_generation must be followed by resume_generation") -> None:
        """Wait (holding the condition) until ``ready()``, at most ``timeout_s``, else a clear error."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise GrpoSdkError(f"hf generation: {what} for {self.timeout_s:g} s (cluster.call_timeout_s); {fix}")
            self._cond.wait(left)

    @contextmanager
    def generation(self) -> Iterator[None]:
        """Around one ``generate`` call: admitted only while not paused."""
        with self._cond:
            self._wait(lambda: not self._paused, "a generate call waited for resume_generation")
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextmanager
    def polling(self) -> Iterator[bool]:
        """Around one ``poll``: like ``generation``, but never waits; yields False (run nothing) while
        paused, except that a ``keep_in_flight`` pause lets the requests already running go on."""
        with self._cond:
            admitted = not self._paused or self._keep_in_flight
            self._running += admitted
        try:
            yield admitted
        finally:
            if admitted:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    @contextmanager
    def forward(self, stale: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Around one forward pass. ``stale()`` says whether the weights changed since the caller's
        KV cache was written; then, during a ``keep_in_flight`` pause, the step waits for ``resume``
        (which decides recompute or keep). Inside the block no update can start."""
        def ready() -> bool:
            return self._updates_waiting == 0 and not (self._paused and self._keep_in_flight and stale())

        with self._cond:
            self._wait(ready, "a request in flight across a weight update waited for resume_generation")
            self._forwards += 1
        try:
            yield
        finally:
            with self._cond:
                self._forwards -= 1
                self._cond.notify_all()

    @contextmanager
    def update(self) -> Iterator[None]:
        """Around one weight copy: waits for the running forward passes (at most one decode step each)
        and keeps new ones out until the copy is done."""
        with self._cond:
            self._updates_waiting += 1
            try:
                self._wait(lambda: self._forwards == 0, "update_weights waited for a forward pass",
                           "a forward pass of the sampler did not end")
                yield  # the copy runs holding the condition: no forward can start
            finally:
                self._updates_waiting -= 1
                self._cond.notify_all()

    def pause(self, *, keep_in_flight: bool) -> None:
        with self._cond:
            self._paused, self._keep_in_flight = True, keep_in_flight
            if not keep_in_flight:
                try:
                    self._wait(lambda: self._running == 0, "pause_generation(keep_in_flight=False) waited for "
                               "the running generate call", "raise the deadline, or pause with keep_in_flight=True")
                except GrpoSdkError:
                    self._paused = False  # the caller learns it failed; new calls are not refused forever
                    raise

    def resume(self, *, recompute_kv_cache: bool) -> None:
        with self._cond:
            self._paused, self._keep_in_flight = False, False
            self.recompute_kv_cache = recompute_kv_cache
            self._cond.notify_all()
