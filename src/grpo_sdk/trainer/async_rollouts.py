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
regenerates from target ``s``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.trainer.collector import CollectorStopped, TargetResult, TrajectoryCollector
from grpo_sdk.trainer.replay_buffer import ReplayBuffer
from grpo_sdk.trainer.rollout import RolloutBatch
from grpo_sdk.trainer.step_rollouts import StepRollouts

ASYNC_DIR = "async"  # inside a checkpoint: buffer.json + buffer.safetensors
POLL_S = 0.25  # how often a waiting trainer looks at the collector's health
REPORT_EVERY_S = 60.0  # a long wait says what it waits for this often


def rewind_to_cut(state: Any, prompts: Any) -> None:
    """Move the data frontier back to the lowest untrained target (a no-op for a synchronous
    checkpoint, which has drawn nothing ahead)."""
    if state.rollouts.get("cut") is not None:
        rewind_to(state.rollouts["cut"], state, prompts)


def rewind_to(frontier: dict[str, Any], state: Any, prompts: Any) -> None:
    prompts.load_state_dict(frontier["data"])
    state.next_group_id = frontier["next_group_id"]
    state.reward_failures = [list(x) for x in frontier["reward_failures"]]


class AsyncRollouts:
    """Example (the trainer's calls, in order)::

        source = AsyncRollouts(cfg, step_rollouts, state)
        source.start(step=state.step, restore_dir=None)   # grants targets step .. step + A
        rollouts, metrics, waited = source.batch_for(step)  # target `step` (0-based), from the buffer
        source.before_weight_sync()                         # the collector is idle from here
        # ... sync weights, validate, save (source.write(checkpoint_dir)) ...
        source.after_step(step + 1)                          # grant step + 1 + A
        source.stop()
    """

    def __init__(self, config: Any, step_rollouts: StepRollouts, state: Any):
        self.config = config
        self.step_rollouts = step_rollouts
        self.state = state  # TrainerState: the collector's counters; its ``rollouts`` dict is ours
        a = config.grpo.async_grpo
        self.max_age = a.max_trajectory_age_steps
        self.timeout = a.starvation_timeout_s
        self.newest = a.schedule == "newest"
        self.in_flight = a.in_flight_weight_updates
        self.recompute = a.recompute_kv_cache_after_weight_updates
        self.last_target = config.grpo.max_num_steps - 1
        self.buffer: ReplayBuffer | None = None
        self.collector: TrajectoryCollector | None = None
        self._saved_groups: list[Any] = []  # the snapshot checkpoint_state took, for write

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self, step: int, restore_dir: Path | None) -> None:
        """Build the buffer (restored from ``restore_dir`` when it holds one) and the collector, and
        grant the first targets. ``step`` is the next step to train (0-based target)."""
        grpo, ckpt = self.config.grpo, self.config.checkpointing
        settings = {"num_prompts_per_step": grpo.num_prompts_per_step,
                    "num_generations": grpo.num_generations_per_prompt, "max_age": self.max_age,
                    "schedule": grpo.async_grpo.schedule}
        buffer, generated_through, saved = None, step - 1, self.state.rollouts
        if restore_dir is not None and step > 0:
            if ckpt.load_replay_buffer and (restore_dir / ASYNC_DIR).is_dir():
                buffer, dropped = ReplayBuffer.read(restore_dir / ASYNC_DIR, step=step, **settings)
                generated_through = self._complete_through(buffer, step)
                if dropped or generated_through != saved.get("through", step - 1 + self.max_age):
                    buffer, generated_through = None, step - 1  # not the saved pipeline: regenerate from the cut
                    print(f"grpo-sdk: the replay buffer in {restore_dir / ASYNC_DIR} does not hold what its "
                          f"checkpoint saved (steps {step + 1}..{saved.get('through', step - 1 + self.max_age) + 1}); "
                          f"regenerating them from the data frontier of step {step + 1}", file=sys.stderr, flush=True)
                elif "resume" in saved:  # the frontier after the saved targets (newest: drawn ones may be lost)
                    rewind_to(saved["resume"], self.state, self.step_rollouts.prompts)
            if buffer is None:
                rewind_to_cut(self.state, self.step_rollouts.prompts)
        self.buffer = buffer or ReplayBuffer(**settings, taken_through=step - 1)
        self.collector = TrajectoryCollector(self.step_rollouts, self.buffer, self.state,
                                             generated_through=generated_through,
                                             num_threads=self.config.cluster.num_threads,
                                             max_failures=self.config.grpo.async_grpo.max_generation_failures)
        if buffer is not None:  # the restored targets' metrics, as the uninterrupted run logs them
            self.collector.results = {int(t): TargetResult(**r) for t, r in self.state.rollouts["results"].items()}
        self.collector.start()
        self.collector.grant(min(step + self.max_age, self.last_target))

    def _complete_through(self, buffer: ReplayBuffer, step: int) -> int:
        """The last target of the run of complete targets from ``step`` on; later ones are dropped."""
        through = step - 1
        while buffer.complete(through + 1):
            through += 1
        return through

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
        return self.collector is not None and self.collector.error is not None

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
        last_progress, seen, reported = time.monotonic(), self.buffer.groups_put, time.monotonic()
        while not self.buffer.wait_for(step, POLL_S):
            self.collector.check()
            if not self.collector.alive:
                raise CollectorStopped(f"the trajectory collector stopped before step {step + 1}'s groups were "
                                       f"complete ({self._status()})")
            now = time.monotonic()
            if self.buffer.groups_put != seen:
                last_progress, seen = now, self.buffer.groups_put
            elif now - last_progress > self.timeout:
                raise GrpoSdkError(f"starved: no prompt group completed for {self.timeout:g} s while step "
                                   f"{step + 1} waited for its groups ({self._status()}): generation is slower "
                                   "than grpo.async_grpo.starvation_timeout_s allows; raise it, or look for a stuck "
                                   "generation or environment call")
            if now - reported >= REPORT_EVERY_S:
                reported = now
                print(f"grpo-sdk: step {step + 1} has waited {time.perf_counter() - start:.0f} s for its prompt "
                      f"groups ({self._status()})", file=sys.stderr, flush=True)
        waited = time.perf_counter() - start
        taken = self.buffer.take(step)
        result = self.collector.pop_result(step)
        self.state.rollouts["epoch"] = result.epoch
        metrics = {**result.metrics, **taken.metrics(), "timing/collector/generation": result.seconds,
                   "timing/collector/failed_generation": result.failed_seconds}
        return taken.rollouts, metrics, waited

    def _status(self) -> str:
        targets = self.buffer.targets()
        held = ", ".join(f"step {t + 1}: {len(s.ordinals)}/{s.needed} groups" for t, s in targets.items())
        return f"buffer: {held or 'empty'}; collector: {self.collector.describe()}"

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
        return time.perf_counter() - start, float(self.buffer.size)

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
        """``TrainerState.rollouts`` for a checkpoint after ``step`` steps: the complete targets from
        ``step`` on (written by ``write``), their metrics, the data frontier before ``step`` (the cut)
        and after the last saved target (where a resume draws next). One consistent snapshot, even
        while the collector works (newest): a target in progress is not saved and is drawn again."""
        with self.collector.snapshot():
            through = self._complete_through(self.buffer, step)
            self._saved_groups = [g for g in self.buffer.groups() if g.target_step <= through]
            results = {str(t): attrs.asdict(r) for t, r in sorted(self.collector.results.items())
                       if step <= t <= through}
            frontiers = {"cut": self.collector.frontier(step), "resume": self.collector.frontier(through + 1)}
        return {**self.state.rollouts, **frontiers, "through": through, "results": results}

    def write(self, directory: Path) -> None:
        self.buffer.write(Path(directory) / ASYNC_DIR, self._saved_groups)
