"""The asynchronous loop's trajectory collector, ``deterministic`` schedule (design/async-grpo.md §3.9).

A thread that generates the target steps the trainer grants, in order, one ``StepRollouts.collect``
per target (the same code as the synchronous step), and puts each target's prompt groups into the
replay buffer tagged with the weight version that generated them. Targets count as the trainer's
``state.step`` does before a step (0-based), and version ``v`` is the weights after ``v`` optimizer
steps, so the synchronous loop trains target ``t`` on rollouts of version ``t``. At start-up the
trainer grants targets ``0 .. A``; after training target ``t`` and syncing version ``t + 1`` it
grants ``t + 1 + A``. So target ``t`` is always generated with the weights ``max(t - A, 0)``: the
schedule does not depend on timing, and with ``A = 0`` the calls are the synchronous loop's, in
the same order.

Who waits for whom::

    trainer:   take(t) -> train t -> drain() -> sync version t+1 -> grant(t+1+A) -> take(t+1) ...
    collector:             generate t+1 .. t+A (older weights) -> idle until granted

``drain`` returns when no target is being generated, so a weight sync never lands mid-generation.
An exception in the thread is kept, wakes the trainer's wait, and is raised again by
``check``/``drain``/``grant`` in the trainer's thread with its own type and text. ``stop`` ends the
thread within a deadline on every path (the trainer opens the collector like any component).

Before drawing a target the collector records the data frontier there (the prompt source's state
and the counters): a resume with ``checkpointing.load_replay_buffer=false`` rewinds to the frontier
of the lowest untrained target and regenerates from it, so no prompt is skipped.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from grpo_sdk.core.errors import ConfigError, GrpoSdkError
from grpo_sdk.runtime.deadlines import WorkerError
from grpo_sdk.rollouts.replay_buffer import BufferedGroup, ReplayBuffer
from grpo_sdk.rollouts.step_rollouts import RolloutCounters, StepRollouts

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

ASYNC_DIR = "async"  # inside a checkpoint: buffer.json + buffer.safetensors
STOP_DEADLINE_S = 30.0  # a generation call is bounded by cluster.call_timeout_s; a stop waits this long for it


class CollectorStopped(GrpoSdkError):
    """The collector was stopped (or failed) while the trainer was waiting for it."""


class TrajectoryCollector:
    """Example::

        collector = TrajectoryCollector(step_rollouts, buffer, counters)
        collector.start()
        collector.grant(A)                                   # targets 0 .. A at start-up
        complete, _, _ = collector.poll(0, timeout=0.25)     # until complete
        rollouts, metrics, epoch = collector.take(0)
        collector.drain(timeout); sync(version=1); collector.grant(1 + A)
        collector.stop()

    The trainer uses only the methods above the thread's section (``AsyncRollouts``); on Ray they
    are remote calls to the actor that holds the collector (``rollouts/collector_worker.py``).
    """

    def __init__(self, step_rollouts: StepRollouts, buffer: ReplayBuffer, counters: RolloutCounters, *,
                 generated_through: int = -1, num_threads: int | None = None, max_failures: int = 0):
        self.step_rollouts = step_rollouts
        self.buffer = buffer
        self.counters = counters
        self.granted_through = generated_through  # every target <= this may be generated
        self.generated_through = generated_through  # every target <= this is in the buffer (or was taken)
        self.num_threads = num_threads  # torch's intra-op threads in the collector thread (cluster.num_threads)
        self.generation_seconds = 0.0
        self.max_failures = max_failures  # grpo.async_grpo.max_generation_failures: consecutive retries
        self.failures = 0  # consecutive failed attempts (a success resets it)
        self.failed_seconds = 0.0  # spent in failed attempts: timing/collector/failed_generation
        self.results: dict[int, TargetResult] = {}  # per generated target, until the trainer pops it
        self.frontiers: dict[int, dict[str, Any]] = {}  # per target: the data frontier before it was drawn
        self.error: BaseException | None = None
        self.busy_since: float | None = None  # time.monotonic() when the target in progress started
        self._busy = False
        self._paused = False
        self._stopping = False
        self._saved_groups: list[BufferedGroup] = []  # what the last checkpoint_state saved, for write
        self._idle = {"paused": 0.0, "limit": 0.0}  # seconds waited before the target in progress started
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    # --- the trainer's side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="grpo-collector", daemon=True)
        self._thread.start()

    def grant(self, through: int) -> None:
        """Allow generating every target up to ``through`` (with the weights the backend holds now)."""
        self.check()
        with self._cond:
            self.granted_through = max(self.granted_through, through)
            self._cond.notify_all()

    def pause(self) -> None:
        """No new target starts until ``resume`` (the one in progress goes on: ``wait_idle``)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def wait_idle(self, timeout: float, before: str) -> None:
        """Return once no target is in progress (after ``pause``: none will start)."""
        self._wait(lambda: self._busy, timeout, before)

    def drain(self, timeout: float) -> None:
        """Return once no target is being generated: every granted one is in the buffer, or the
        collector failed (``check`` raises that; the step that trained meanwhile is kept)."""
        self._wait(lambda: self._busy or self.generated_through < self.granted_through, timeout, "the weight update")

    def _wait(self, busy: Any, timeout: float, before: str) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while busy() and self.error is None:
                if not self.alive:
                    raise CollectorStopped(f"the trajectory collector stopped before {before} ({self.describe()})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GrpoSdkError(f"starved: the trajectory collector did not finish within {timeout:g} s "
                                       f"(grpo.async_grpo.starvation_timeout_s) before {before} "
                                       f"({self.describe()}); raise the deadline, or look for a stuck generation "
                                       "or environment call")
                self._cond.wait(min(left, 0.25))

    def check(self) -> None:
        """Raise the collector's error, if it had one, in the caller's thread."""
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.buffer.wake()
        if self._thread is not None:
            self._thread.join(STOP_DEADLINE_S)

    def shutdown(self) -> None:  # SupportsShutdown: the trainer stops what it opened
        self.stop()

    def describe(self) -> str:
        """What the collector is doing, for a starving trainer's report."""
        with self._cond:
            if self.error is not None:
                return f"failed: {type(self.error).__name__}: {self.error}"
            if self._busy and self.busy_since is not None:
                doing = (f"generating step {self.generated_through + 2} for {time.monotonic() - self.busy_since:.0f} s"
                         + (f" after {self.failures} failed attempt(s)" if self.failures else ""))
            elif self.generated_through >= self.granted_through:
                doing = "idle: every granted step is generated"
            else:
                doing = "starting"
            return (f"{doing}; granted through step {self.granted_through + 1}, generated through step "
                    f"{self.generated_through + 1}")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def poll(self, target: int, timeout: float) -> tuple[bool, int, bool]:
        """Wait up to ``timeout`` s for ``target``'s groups: (complete, groups put so far, thread
        alive); the collector's error, if it failed meanwhile, is raised instead."""
        complete = self.buffer.wait_for(target, timeout)
        if not complete:
            self.check()
        return complete, self.buffer.groups_put, self.alive

    def take(self, target: int) -> tuple[Any, dict[str, float], int]:
        """A complete target's rollouts, their metrics (rollout, buffer and collector timing) and the
        data epoch after drawing them; removed from the buffer."""
        with self._cond:
            taken = self.buffer.take(target)
            if taken is None:
                raise GrpoSdkError(f"step {target + 1} was taken before its groups were complete ({self.status()})")
            result = self.results.pop(target)
        metrics = {**result.metrics, **taken.metrics(), "timing/collector/generation": result.seconds,
                   "timing/collector/failed_generation": result.failed_seconds,
                   "timing/collector/generation_limit_pause": result.limit_seconds,
                   "timing/collector/paused_for_trainer": result.paused_seconds}
        return taken.rollouts, metrics, result.epoch

    def buffer_size(self) -> int:
        return self.buffer.size

    def status(self) -> str:
        """The buffer's targets and what the collector is doing, for a starving trainer's report."""
        held = ", ".join(f"step {t + 1}: {len(s.ordinals)}/{s.needed} groups" for t, s in self.buffer.targets().items())
        return f"buffer: {held or 'empty'}; collector: {self.describe()}"

    # --- checkpoints (a consistent snapshot even while the thread draws) ---------------------------

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` trained steps records of the pipeline: the complete
        targets from ``step`` on (``through``; ``write`` writes their groups), their metrics, and the
        data frontiers before ``step`` (``cut``) and after ``through`` (``resume``: where a resume
        draws next). Taken under the lock the thread puts a target's groups and result with, so a
        target in progress is not saved and is drawn again."""
        with self._cond:
            through = complete_through(self.buffer, step)
            self._saved_groups = [g for g in self.buffer.groups() if g.target_step <= through]
            results = {str(t): attrs.asdict(r) for t, r in sorted(self.results.items()) if step <= t <= through}
            return {"cut": self._frontier(step), "resume": self._frontier(through + 1), "through": through,
                    "results": results}

    def write(self, directory: str | Path) -> None:
        """The groups the last ``checkpoint_state`` saved, as ``buffer.json`` + ``buffer.safetensors``."""
        self.buffer.write(Path(directory), self._saved_groups)

    def _frontier(self, target: int) -> dict[str, Any]:
        """The data frontier before ``target`` was drawn; the live one if it was not drawn yet (under
        the lock: the thread records a target's frontier under it before it draws)."""
        return self.frontiers[target] if target in self.frontiers else self._frontier_now()

    def _frontier_now(self) -> dict[str, Any]:
        return {"data": self.step_rollouts.prompts.state_dict(), "next_group_id": self.counters.next_group_id,
                "reward_failures": [list(x) for x in self.counters.reward_failures]}

    # --- the thread ---------------------------------------------------------------------------

    def _next_target(self) -> int | None:
        """Wait for a target to generate; the wait is counted as NeMo-RL's efficiency categories:
        ``paused`` (the trainer has the engine: a refit or validation) or ``limit`` (every granted
        target is generated: the age window is full, generation is ahead of training)."""
        with self._cond:
            while not self._stopping and (self._paused or self.generated_through >= self.granted_through):
                why, since = ("paused" if self._paused else "limit"), time.perf_counter()
                self._cond.wait(0.25)
                self._idle[why] += time.perf_counter() - since
            if self._stopping:
                return None
            self._busy = True
            self.busy_since = time.monotonic()
            return self.generated_through + 1

    def _generate(self, target: int) -> tuple[Any, dict[str, float], float, float]:
        """One target's rollouts, retried from its frontier (same prompts, same group ids) up to
        ``max_failures`` consecutive failures; a lost worker or a config error is not retried."""
        wasted = 0.0
        while True:
            start = time.perf_counter()
            try:
                rollouts, metrics = self.step_rollouts.collect(target + 1, self.counters)  # 1-based in messages
            except (WorkerError, ConfigError):
                raise
            except Exception as exc:
                wasted += time.perf_counter() - start
                with self._cond:
                    self.failed_seconds += time.perf_counter() - start
                    self.failures += 1
                    frontier, stopping = self.frontiers[target], self._stopping
                if self.max_failures == 0 or stopping:
                    raise  # as the synchronous loop: the error itself
                grpo = self.step_rollouts.config.grpo  # the failing batch's groups are not counted yet
                draw = int(grpo.num_prompts_per_step * (grpo.batch_multiplier if grpo.use_dynamic_sampling else 1))
                groups = f"{frontier['next_group_id']}..{self.counters.next_group_id + draw - 1}"
                if self.failures > self.max_failures:
                    raise GrpoSdkError(
                        f"generating step {target + 1}'s rollouts (prompt groups {groups}) failed {self.failures} "
                        f"times in a row (grpo.async_grpo.max_generation_failures={self.max_failures}): "
                        f"{type(exc).__name__}: {exc}") from exc
                print(f"grpo-sdk: generating step {target + 1}'s rollouts (prompt groups {groups}) failed "
                      f"({type(exc).__name__}: {exc}); retrying, failure {self.failures} of "
                      f"{self.max_failures} allowed in a row", file=sys.stderr, flush=True)
                self._restore_frontier(frontier)
                continue
            self.failures = 0
            return rollouts, metrics, time.perf_counter() - start, wasted

    def _restore_frontier(self, frontier: dict[str, Any]) -> None:
        self.step_rollouts.prompts.load_state_dict(frontier["data"])
        self.counters.next_group_id = frontier["next_group_id"]
        self.counters.reward_failures = [list(x) for x in frontier["reward_failures"]]

    def _run(self) -> None:
        try:
            if self.num_threads:  # OpenMP's thread count is per thread: a new thread starts at the default
                torch.set_num_threads(self.num_threads)
            while (target := self._next_target()) is not None:
                with self._cond:
                    self.frontiers[target] = self._frontier_now()
                    for old in [t for t in self.frontiers if t < target - self.buffer.max_age - 1]:
                        del self.frontiers[old]
                rollouts, metrics, seconds, wasted = self._generate(target)
                epoch = self.step_rollouts.prompts.epoch
                with self._cond:  # groups and their result together: a checkpoint sees both or neither
                    for group in split_groups(rollouts, target, epoch=epoch, seconds=seconds):
                        self.buffer.put(group)
                    self.generation_seconds += seconds
                    self.results[target] = TargetResult(metrics=metrics, seconds=seconds, epoch=epoch,
                                                        failed_seconds=wasted, limit_seconds=self._idle["limit"],
                                                        paused_seconds=self._idle["paused"])
                    self._idle = {"paused": 0.0, "limit": 0.0}
                    self.generated_through = target
                    self._busy = False
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - kept for the trainer's thread, which raises it
            self.error = exc
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            self.buffer.wake()


@attrs.frozen
class TargetResult:
    """What the trainer logs for a target besides its groups: the rollout metrics of its
    ``StepRollouts.collect``, the seconds it took, and the data epoch after drawing it."""

    metrics: dict[str, float]
    seconds: float
    epoch: int
    failed_seconds: float = 0.0  # spent in failed attempts before the one that succeeded
    limit_seconds: float = 0.0  # idle before it started: every granted target was generated (the age window)
    paused_seconds: float = 0.0  # idle before it started: paused while the trainer had the engine


def complete_through(buffer: ReplayBuffer, step: int) -> int:
    """The last target of the run of complete targets from ``step`` on (``step - 1``: none)."""
    through = step - 1
    while buffer.complete(through + 1):
        through += 1
    return through


def rewind_to_cut(saved: dict[str, Any], counters: Any, prompts: Any) -> None:
    """Move the data frontier back to the lowest untrained target, the cut a checkpoint's
    ``TrainerState.rollouts`` (``saved``) holds (a no-op for a synchronous checkpoint, which has
    drawn nothing ahead)."""
    if saved.get("cut") is not None:
        rewind_to(saved["cut"], counters, prompts)


def rewind_to(frontier: dict[str, Any], counters: Any, prompts: Any) -> None:
    prompts.load_state_dict(frontier["data"])
    counters.next_group_id = frontier["next_group_id"]
    counters.reward_failures = [list(x) for x in frontier["reward_failures"]]


def open_collector(config: MasterConfig, step_rollouts: StepRollouts, counters: Any, *, step: int,
                   restore_dir: str | Path | None, saved: dict[str, Any]) -> TrajectoryCollector:
    """The buffer (restored from ``restore_dir`` when it holds what its checkpoint saved) and the
    collector over it, started; nothing granted yet. ``step`` is the next step to train (0-based
    target), ``counters`` the data counters the collector advances, ``saved`` the checkpoint's
    ``TrainerState.rollouts``. Where the collector runs: in the trainer's process (a thread) or in
    the Ray runtime's collector actor (``grpo_sdk.rollouts.collector_worker``)."""
    grpo, a = config.grpo, config.grpo.async_grpo
    settings = {"num_prompts_per_step": grpo.num_prompts_per_step, "num_generations": grpo.num_generations_per_prompt,
                "max_age": a.max_trajectory_age_steps, "schedule": a.schedule}
    buffer, generated_through, prompts = None, step - 1, step_rollouts.prompts
    if restore_dir is not None and step > 0:
        restore_dir = Path(restore_dir)
        expected = saved.get("through", step - 1 + a.max_trajectory_age_steps)
        if config.checkpointing.load_replay_buffer and (restore_dir / ASYNC_DIR).is_dir():
            buffer, dropped = ReplayBuffer.read(restore_dir / ASYNC_DIR, step=step, **settings)
            generated_through = complete_through(buffer, step)
            if dropped or generated_through != expected:
                buffer, generated_through = None, step - 1  # not the saved pipeline: regenerate from the cut
                print(f"grpo-sdk: the replay buffer in {restore_dir / ASYNC_DIR} does not hold what its checkpoint "
                      f"saved (steps {step + 1}..{expected + 1}); regenerating them from the data frontier of step "
                      f"{step + 1}", file=sys.stderr, flush=True)
            elif "resume" in saved:  # the frontier after the saved targets (newest: drawn ones may be lost)
                rewind_to(saved["resume"], counters, prompts)
        if buffer is None:
            rewind_to_cut(saved, counters, prompts)
    collector = TrajectoryCollector(step_rollouts, buffer or ReplayBuffer(**settings, taken_through=step - 1),
                                    counters, generated_through=generated_through,
                                    num_threads=config.cluster.num_threads, max_failures=a.max_generation_failures)
    if buffer is not None:  # the restored targets' metrics, as the uninterrupted run logs them
        collector.results = {int(t): TargetResult(**r) for t, r in saved["results"].items()}
    collector.start()
    return collector


def split_groups(rollouts: Any, target: int, *, epoch: int, seconds: float = 0.0) -> list[BufferedGroup]:
    """One BufferedGroup per prompt group of a target's rollouts, in group-id order, tagged with the
    oldest and newest weight versions of its tokens (the backend reports them; one version unless
    an update landed in flight)."""
    groups = []
    for ordinal in torch.unique(rollouts.group_ids).tolist():
        rows = torch.nonzero(rollouts.group_ids == ordinal).flatten()
        group = rollouts.select(rows)
        first = last = group.weight_version
        versions = group.token_weight_versions
        if versions is not None:
            sampled = group.sampled
            if sampled.any():
                first, last = int(versions[sampled].min()), int(versions[sampled].max())
        groups.append(BufferedGroup(ordinal=int(ordinal), target_step=target, weight_version=first,
                                    last_weight_version=last, epoch=epoch, rollouts=group,
                                    generation_seconds=seconds, token_weight_versions=versions))
    return groups
