"""Where an async step's rollouts come from: the trajectory collector and the replay buffer
(issue 15, design/async-grpo.md §3.1 and §3.9, docs/async.md).

The trainer's step is the synchronous one with a few seams: ``batch_for(t)`` replaces generating
the step's rollouts inline (it waits for target ``t`` in the buffer, with a deadline), and
``before_weight_sync()`` / ``after_weight_sync(v)`` wrap the weight update. ``deterministic``
drains the collector before the update and grants the next target in ``after_step(step)``, once
the step's validation and checkpoint are done, so both see a quiet pipeline. ``newest`` grants
up to ``v + A`` at the update itself; without in-flight updates the target in progress finishes
first, with them the backend keeps decoding across the update (``PausesForRefit``). Validation
runs inside ``paused()``: the trainer has the engine to itself.

Exact resume (``deterministic``): a checkpoint after step ``s`` holds the buffer (targets
``s .. s-1+A``, complete), the data frontier after them (``TrainerState.data``, the counters) and
the frontier before target ``s`` (``TrainerState.rollouts["cut"]``). Resuming restores the buffer
and grants ``s + A`` with the checkpoint's weights ``s``: the calls of the uninterrupted run, in
its order. With ``checkpointing.load_replay_buffer=false`` the source rewinds to the cut and
regenerates from target ``s`` (``collector.open_collector``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.rollouts.collector import ASYNC_DIR, CollectorStopped, open_collector
from grpo_sdk.rollouts.rollout import RolloutBatch
from grpo_sdk.rollouts.step_rollouts import StepRollouts

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

POLL_S = 0.25  # how often a waiting trainer looks at the collector's health
REPORT_EVERY_S = 60.0  # a long wait says what it waits for this often


class AsyncRollouts:
    """Example (the trainer's calls, in order)::

        source = AsyncRollouts(cfg, step_rollouts, state, runtime)
        source.start(step=state.step, restore_dir=None)   # grants targets step .. step + A
        rollouts, metrics, waited = source.batch_for(step)  # target `step` (0-based), from the buffer
        source.before_weight_sync()                         # the collector is idle from here
        # ... sync weights, validate, save (source.write(checkpoint_dir)) ...
        source.after_step(step + 1)                          # grant step + 1 + A
        source.stop()

    The collector is a ``TrajectoryCollector`` in this process, or on a runtime that offers one
    (Ray: ``grpo_sdk.rollouts.collector_worker``) a proxy with the same methods over the collector's actor.
    """

    def __init__(self, config: MasterConfig, step_rollouts: StepRollouts, state: Any, runtime: Any = None):
        self.config = config
        self.step_rollouts = step_rollouts
        self.state = state  # TrainerState: the collector's counters; its ``rollouts`` dict is ours
        self.runtime = runtime
        a = config.grpo.async_grpo
        self.max_age = a.max_trajectory_age_steps
        self.timeout = a.starvation_timeout_s
        self.newest = a.schedule == "newest"
        self.in_flight = a.in_flight_weight_updates
        self.recompute = a.recompute_kv_cache_after_weight_updates
        self.last_target = config.grpo.max_num_steps - 1
        self.collector: Any = None  # TrajectoryCollector or the runtime's proxy of one

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self, step: int, restore_dir: Path | None) -> None:
        """Start the collector (its buffer restored from ``restore_dir`` when it holds one) and grant
        the first targets. ``step`` is the next step to train (0-based target)."""
        if hasattr(self.runtime, "start_actor_on_driver_node"):  # Ray: next to the generation workers
            from grpo_sdk.rollouts.collector_worker import start_remote_collector

            self.collector = start_remote_collector(self.runtime, self.step_rollouts, self.state, step=step,
                                                    restore_dir=restore_dir)
        else:
            self.collector = open_collector(self.config, self.step_rollouts, self.state, step=step,
                                            restore_dir=restore_dir, saved=self.state.rollouts)
        self.collector.grant(min(step + self.max_age, self.last_target))

    def after_step(self, step: int) -> None:
        """``step`` steps are trained, validated and saved. Deterministic: grant targets up to
        ``step + A`` now (the newest schedule granted them at the weight update)."""
        if not self.newest:
            self.collector.grant(min(step + self.max_age, self.last_target))

    @contextlib.contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """No generation while the trainer uses the engine itself (validation): new targets wait,
        the one in progress finishes first (deterministic: the collector is idle here anyway)."""
        self.collector.pause()
        try:
            self.collector.wait_idle(self.timeout, what)
            yield
        finally:
            self.collector.resume()

    @property
    def failed(self) -> bool:
        return self.collector is not None and self.collector.failed

    def check(self) -> None:
        self.collector.check()

    def stop(self) -> None:
        if self.collector is not None:
            self.collector.stop()

    def shutdown(self) -> None:  # SupportsShutdown: opened by the trainer, stopped on every path
        self.stop()

    # --- one step -----------------------------------------------------------------------------------

    def batch_for(self, step: int) -> tuple[RolloutBatch, dict[str, float], float]:
        """Target ``step``'s rollouts, their metrics (rollout and buffer metrics), and the seconds the
        trainer waited for them. Waits while groups keep arriving; stops with a report when the
        collector failed or stopped, or when no group completed for ``starvation_timeout_s``."""
        start = time.perf_counter()
        last_progress, seen, reported = time.monotonic(), -1, time.monotonic()
        while True:
            complete, put, alive = self.collector.poll(step, POLL_S)
            if complete:
                break
            if not alive:
                raise CollectorStopped(f"the trajectory collector stopped before step {step + 1}'s groups were "
                                       f"complete ({self.collector.status()})")
            now = time.monotonic()
            if put != seen:
                last_progress, seen = now, put
            elif now - last_progress > self.timeout:
                raise GrpoSdkError(f"starved: no prompt group completed for {self.timeout:g} s while step "
                                   f"{step + 1} waited for its groups ({self.collector.status()}): generation is slower "
                                   "than grpo.async_grpo.starvation_timeout_s allows; raise it, or look for a stuck "
                                   "generation or environment call")
            if now - reported >= REPORT_EVERY_S:
                reported = now
                print(f"grpo-sdk: step {step + 1} has waited {time.perf_counter() - start:.0f} s for its prompt "
                      f"groups ({self.collector.status()})", file=sys.stderr, flush=True)
        waited = time.perf_counter() - start
        rollouts, metrics, self.state.rollouts["epoch"] = self.collector.take(step)
        return rollouts, metrics, waited

    def before_weight_sync(self) -> tuple[float, float]:
        """Make way for the weight update; returns the seconds that took (the refit bubble) and the
        groups then in the buffer. Deterministic: wait until every granted target is generated
        (then the count does not depend on timing). Newest: no new target starts, and without
        in-flight updates the one in progress finishes first; with them the backend keeps decoding
        and the update lands between two decode steps."""
        start = time.perf_counter()
        if not self.newest:
            self.collector.drain(self.timeout)
        else:
            self.collector.pause()
            if self.in_flight:
                self.step_rollouts.generation.pause_generation(keep_in_flight=True)
            else:
                self.collector.wait_idle(self.timeout, "the weight update")
        return time.perf_counter() - start, float(self.collector.buffer_size())

    def after_weight_sync(self, version: int) -> None:
        """The engine holds ``version``. Newest: targets up to ``version + A`` may start now."""
        if not self.newest:
            return
        if self.in_flight:
            self.step_rollouts.generation.resume_generation(recompute_kv_cache=self.recompute)
        self.collector.grant(min(version + self.max_age, self.last_target))
        self.collector.resume()

    # --- checkpoints --------------------------------------------------------------------------------

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """``TrainerState.rollouts`` for a checkpoint after ``step`` steps: the collector's snapshot
        (``TrajectoryCollector.checkpoint_state``: the saved targets, their metrics, the cut and the
        resume frontier) with what the trainer keeps there itself (the trained epoch)."""
        return {**self.state.rollouts, **self.collector.checkpoint_state(step)}

    def write(self, directory: Path) -> None:
        self.collector.write(str(Path(directory) / ASYNC_DIR))
