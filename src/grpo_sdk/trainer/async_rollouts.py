"""Where an async step's rollouts come from: the trajectory collector and the replay buffer
(issue 15, design/async-grpo.md §3.1 and §3.9, docs/async.md).

The trainer's step is the synchronous one with two seams: ``batch_for(t)`` replaces generating
the step's rollouts inline (it waits for target ``t`` in the buffer, with a deadline), and
``before_weight_sync()`` runs before the weights move (the collector finishes what it is
generating, so one engine never mixes two versions in a target). ``after_step(step)`` grants the
next target once the step's validation and checkpoint are done: the collector is idle during
both, so validation and the saved buffer see a quiet pipeline.

Exact resume (``deterministic``): a checkpoint after step ``s`` holds the buffer (targets
``s .. s-1+A``, complete), the data frontier after them (``TrainerState.data``, the counters) and
the frontier before target ``s`` (``TrainerState.rollouts["cut"]``). Resuming restores the buffer
and grants ``s + A`` with the checkpoint's weights ``s``: the calls of the uninterrupted run, in
its order. With ``checkpointing.load_replay_buffer=false`` the source rewinds to the cut and
regenerates from target ``s``.
"""

from __future__ import annotations

import sys
import time
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
    cut = state.rollouts.get("cut")
    if cut is None:
        return
    prompts.load_state_dict(cut["data"])
    state.next_group_id = cut["next_group_id"]
    state.reward_failures = [list(x) for x in cut["reward_failures"]]


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
        self.buffer: ReplayBuffer | None = None
        self.collector: TrajectoryCollector | None = None

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self, step: int, restore_dir: Path | None) -> None:
        """Build the buffer (restored from ``restore_dir`` when it holds one) and the collector, and
        grant the first targets. ``step`` is the next step to train (0-based target)."""
        grpo, ckpt = self.config.grpo, self.config.checkpointing
        settings = {"num_prompts_per_step": grpo.num_prompts_per_step,
                    "num_generations": grpo.num_generations_per_prompt, "max_age": self.max_age,
                    "schedule": grpo.async_grpo.schedule}
        buffer, generated_through = None, step - 1
        if restore_dir is not None and step > 0:
            if ckpt.load_replay_buffer and (restore_dir / ASYNC_DIR).is_dir():
                buffer, dropped = ReplayBuffer.read(restore_dir / ASYNC_DIR, step=step, **settings)
                generated_through = self._complete_through(buffer, step)
                if dropped or generated_through != min(step - 1 + self.max_age, grpo.max_num_steps - 1):
                    buffer, generated_through = None, step - 1  # not the saved pipeline: regenerate from the cut
                    print(f"grpo-sdk: the replay buffer in {restore_dir / ASYNC_DIR} does not hold steps "
                          f"{step + 1}..{step + self.max_age} complete; regenerating them from the data frontier of "
                          f"step {step + 1}", file=sys.stderr, flush=True)
            if buffer is None:
                self._rewind_to_cut()
        self.buffer = buffer or ReplayBuffer(**settings, taken_through=step - 1)
        self.collector = TrajectoryCollector(self.step_rollouts, self.buffer, self.state,
                                             generated_through=generated_through,
                                             num_threads=self.config.cluster.num_threads,
                                             max_failures=self.config.grpo.async_grpo.max_generation_failures)
        if buffer is not None:  # the restored targets' metrics, as the uninterrupted run logs them
            self.collector.results = {int(t): TargetResult(**r) for t, r in self.state.rollouts["results"].items()}
        self.collector.start()
        self.after_step(step)

    def _complete_through(self, buffer: ReplayBuffer, step: int) -> int:
        """The last target of the run of complete targets from ``step`` on; later ones are dropped."""
        through = step - 1
        while buffer.complete(through + 1):
            through += 1
        return through

    def _rewind_to_cut(self) -> None:
        rewind_to_cut(self.state, self.step_rollouts.prompts)

    def after_step(self, step: int) -> None:
        """Grant targets up to ``step + A`` (never past the last step)."""
        last = self.config.grpo.max_num_steps - 1
        self.collector.grant(min(step + self.max_age, last))

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
        """Wait until the collector generated every granted target; returns the seconds waited and
        the groups then in the buffer (at this moment the count does not depend on timing)."""
        start = time.perf_counter()
        self.collector.drain(self.timeout)
        return time.perf_counter() - start, float(self.buffer.size)

    # --- checkpoints --------------------------------------------------------------------------------

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """``TrainerState.rollouts`` for a checkpoint after ``step`` steps (the collector is idle)."""
        results = {str(t): attrs.asdict(r) for t, r in sorted(self.collector.results.items())}
        return {**self.state.rollouts, "cut": self.collector.frontier(step), "results": results}

    def write(self, directory: Path) -> None:
        self.buffer.write(Path(directory) / ASYNC_DIR)

    @property
    def epoch(self) -> int:
        return int(self.state.rollouts.get("epoch", 0))
