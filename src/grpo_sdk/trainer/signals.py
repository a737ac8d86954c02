"""SIGINT, SIGTERM and SIGHUP: a request to stop at the next safe point, not a crash.

Schedulers (Slurm, Kubernetes, cloud preemption) send SIGTERM and wait before they kill; a closed
terminal sends SIGHUP. The first of these signals sets a flag: the run finishes (or, before the
first step, abandons) the step in progress, saves a checkpoint, writes ``summary.json`` with the
reason, and exits with 128 + the signal number (130, 143, 129). A second signal stops at once by
raising ``StopNow`` wherever the process is.

``STOP`` is process-wide. ``grpoctl`` installs it first thing, before torch is imported, so a
signal that arrives while the process starts is honoured too: in ``immediate`` mode (every
command but ``run`` until its training loop is ready to stop cleanly) the first signal raises
``StopNow`` at once, which is what a user pressing Ctrl-C during start-up expects.
Ray's ``ray.init`` installs its own SIGTERM handler; the trainer calls ``STOP.reinstall()`` after
it, so SIGTERM stays ours.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code_of(signum: int) -> int:
    return 128 + int(signum)


class StopNow(KeyboardInterrupt):
    """Raised by a stop signal that must not wait (a second one, or one before a run can stop cleanly)."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


class StopRequests:
    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal received
        self.deferred = False  # True while a training loop will honour a request at its next safe point
        self.stopped_now = False  # a StopNow was raised (library code may re-raise it as another exception)
        self.exiting = False  # grpoctl is returning its exit code: a signal is noted, never raised
        self.installed = False
        self._previous: dict[int, object] = {}  # (no typing import: this loads first in grpoctl)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> bool:
        """Take over the stop signals (main thread only: Python delivers signals there). Idempotent."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        self.installed = True  # first: a signal between the calls below must find uninstall() able to undo them
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return True

    def reinstall(self) -> None:
        """After a library (Ray) replaced a handler."""
        if self.installed and threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        if self.installed and threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.installed = False

    def ignore_while_exiting(self) -> None:
        """The process is on its way out because of a signal: a repeat must not kill it with -N. Python
        resets its own handlers to the default at finalization, but leaves SIG_IGN alone."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
        self.installed = False

    def reset(self) -> None:
        self.signum, self.deferred, self.stopped_now, self.exiting = None, False, False, False

    def _handle(self, signum: int, frame: object) -> None:
        if self.exiting:  # a repeat while grpoctl returns: raising now would only print a traceback
            self.signum = self.signum or signum
            return
        if self.signum is not None or not self.deferred:
            self.signum = self.signum or signum
            self.stopped_now = True  # whatever the raise turns into on its way up, it was this signal
            raise StopNow(signum)
        self.signum = signum
        print(f"\n{signal_name(signum)}: finishing this step and saving a checkpoint "
              f"(send it again to stop now)", flush=True)


STOP = StopRequests()
