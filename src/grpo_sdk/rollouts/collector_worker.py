"""Async GRPO's trajectory collector as a Ray actor, next to the generation workers (issue 15,
design/async-grpo.md §3.7, docs/async.md).

On ``cluster.runtime: ray`` the collector does not run in the trainer's process: one
``CollectorWorker`` actor, on the driver's node (data files read the same), holds the whole
collecting side of the loop. It draws the prompts, calls the generation replicas and environment
actors directly (through proxies of its own over the same actors, every call with the run's
deadline), scores, and keeps the replay buffer; a group crosses to the driver only when the trainer
takes its step. The driver holds a ``RemoteCollector``, a worker group of one with the trainer-side
methods of ``TrajectoryCollector``, so ``AsyncRollouts`` drives either without knowing which.

What crosses, and when::

    driver (trainer)                      collector actor                    generation / env actors
    grant(t + A) ───────────────────────► thread: draw, generate ─────────► generate(), step()
    poll(t) ◄──── complete? ───────────── buffer
    take(t) ◄──── rollouts of t ───────── buffer
    pause_generation / update_weights ───────────────────────────────────► generation (max_concurrency 2
                                                                             with in-flight updates)

Failures: the actor dying (or not answering within its deadline) is a ``WorkerError`` naming
"collector worker 0"; a generation or environment worker lost under the collector's own calls
comes back as that worker's ``WorkerError``; either stops the run like any lost worker. A
collector error (retries exhausted, a broken reward function) is raised in the trainer with its
own type and text, as in-process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo_sdk.runtime.deadlines import WorkerError, WorkerHandle
from grpo_sdk.runtime.groups import (EnvironmentPool, GenerationGroup, WorkerGroup, local_methods,
                                    local_sampler_factory)
from grpo_sdk.runtime.workers import ComponentWorker, attribute_op, worker_registry

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

STOP_MARGIN_S = 60.0  # a remote wait gets this much longer than the wait itself, which reports first


@attrs.frozen(kw_only=True)
class CollectorSpec:
    """What the collector actor needs to build the collecting side of the loop (all picklable)."""

    config: MasterConfig
    context: Any  # RunContext, registry=None
    generation_workers: tuple[WorkerHandle, ...]
    generation_methods: frozenset[str]
    environment_workers: tuple[WorkerHandle, ...]
    environment_methods: frozenset[str]
    environment_config: Any  # the environment's plugin config, as its workers were built with
    sampling: Any
    max_prompt_tokens: int
    step: int  # the next step to train (0-based target)
    restore_dir: str | None
    state: dict[str, Any]  # data (the prompt source's state), next_group_id, reward_failures, rollouts
    cwd: str  # the driver's working directory: relative data paths resolve as in the driver
    hook_modules: tuple[str, ...] = ()
    sys_path: tuple[str, ...] = ()


@attrs.define
class Counters:
    """The data counters the collector advances (``RolloutCounters``); in-process they are the
    trainer's ``TrainerState``, here the actor's own."""

    next_group_id: int = 0
    reward_failures: list[list[int]] = attrs.field(factory=list)


class _Deadlines:
    """What the actor's proxies need of a runtime: the call deadline, and the first lost worker
    (after which they make no more calls)."""

    def __init__(self, call_timeout: float):
        self.call_timeout = call_timeout
        self.failure: WorkerError | None = None

    def record_failure(self, error: WorkerError) -> None:
        if self.failure is None:
            self.failure = error


class CollectorWorker(ComponentWorker):
    """The actor: its component is the ``TrajectoryCollector`` (``call`` forwards to it)."""

    def setup(self, spec: CollectorSpec) -> dict[str, Any]:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from grpo_sdk.core.models import load_tokenizer
        from grpo_sdk.rollouts.collector import open_collector
        from grpo_sdk.data.prompt_sources import make_prompt_source
        from grpo_sdk.rollouts.step_rollouts import StepRollouts

        if Path(spec.cwd).is_dir():
            os.chdir(spec.cwd)
        cfg = spec.config
        registry = worker_registry(spec.hook_modules, spec.sys_path)
        context = attrs.evolve(spec.context, registry=registry)
        deadlines = _Deadlines(float(cfg.cluster.call_timeout_s))
        generation = GenerationGroup(deadlines, list(spec.generation_workers), tokenizer_path=context.tokenizer_path,
                                     pad_token_id=context.pad_token_id)
        generation.methods = spec.generation_methods
        impl = registry.load_impl("environment", cfg.env.name)
        self.environment = EnvironmentPool(deadlines, list(spec.environment_workers),
                                           max_concurrency=cfg.cluster.env_max_concurrency,
                                           local_factory=local_sampler_factory(impl, spec.environment_config, context),
                                           local_methods=local_methods(impl))
        self.environment.methods = spec.environment_methods
        tokenizer = load_tokenizer(context.tokenizer_path)
        prompts = make_prompt_source(cfg, self.environment, tokenizer, spec.max_prompt_tokens)
        if spec.restore_dir is not None:
            prompts.load_state_dict(spec.state["data"])
        counters = Counters(spec.state["next_group_id"], [list(x) for x in spec.state["reward_failures"]])
        step_rollouts = StepRollouts(cfg, prompts=prompts, tokenizer=tokenizer, generation=generation,
                                     environment=self.environment, sampling=spec.sampling,
                                     max_prompt_tokens=spec.max_prompt_tokens)
        self.component = open_collector(cfg, step_rollouts, counters, step=spec.step, restore_dir=spec.restore_dir,
                                        saved=spec.state["rollouts"])
        return {"pid": os.getpid(), "node": self.ping()["node"], "methods": []}

    def teardown(self) -> None:
        from grpo_sdk.rollouts.agent_rollouts import close_endpoints

        try:
            if self.component is not None:
                self.component.stop()
            close_endpoints()  # an agent environment's endpoint served from this worker
        finally:
            self.component = None
            environment = getattr(self, "environment", None)
            if environment is not None:
                environment.close_local()  # the environment actors are the driver's to stop


def start_remote_collector(runtime: Any, step_rollouts: Any, state: Any, *, step: int,
                           restore_dir: Path | None) -> RemoteCollector:
    """The collector actor over the generation replicas and environment actors of ``step_rollouts``
    (the driver's proxies), its buffer restored from ``restore_dir``; the driver's handle on it."""
    generation, environment = step_rollouts.generation, step_rollouts.environment
    modules, roots = runtime.hook_modules()
    spec = CollectorSpec(
        config=runtime.config, context=attrs.evolve(environment.specs[0].context, registry=None),
        generation_workers=tuple(generation.workers), generation_methods=generation.methods,
        environment_workers=tuple(environment.workers), environment_methods=environment.methods,
        environment_config=environment.specs[0].config, sampling=step_rollouts.sampling,
        max_prompt_tokens=step_rollouts.max_prompt_tokens, step=step,
        restore_dir=str(restore_dir) if restore_dir is not None else None,
        state={"data": state.data, "next_group_id": state.next_group_id, "reward_failures": state.reward_failures,
               "rollouts": state.rollouts},
        cwd=os.getcwd(), hook_modules=modules, sys_path=roots)
    # max_concurrency: the trainer's calls (poll, take, pause, checkpoint_state) run while the
    # collector's own thread collects.
    return runtime.start_actor_on_driver_node(CollectorWorker, RemoteCollector, role="collector", spec=spec,
                                              max_concurrency=4)


class RemoteCollector(WorkerGroup):
    """The driver's handle on the collector actor: ``TrajectoryCollector``'s trainer-side methods,
    each a remote call with a deadline (a wait's own timeout plus a margin, else
    ``cluster.call_timeout_s``)."""

    role = "collector"

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        try:
            return self._call_all(method, *args, timeout=timeout)
        except WorkerError as exc:  # lost here, or under the collector's own calls: the run lost a worker
            self.runtime.record_failure(exc)
            raise

    def grant(self, through: int) -> None:
        self._call("grant", through)

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def wait_idle(self, timeout: float, before: str) -> None:
        self._call("wait_idle", timeout, before, timeout=timeout + STOP_MARGIN_S)

    def drain(self, timeout: float) -> None:
        self._call("drain", timeout, timeout=timeout + STOP_MARGIN_S)

    def check(self) -> None:
        self._call("check")

    def poll(self, target: int, timeout: float) -> tuple[bool, int, bool]:
        return self._call("poll", target, timeout, timeout=timeout + self.runtime.call_timeout)

    def take(self, target: int) -> tuple[Any, dict[str, float], int]:
        return self._call("take", target)

    def buffer_size(self) -> int:
        return self._call("buffer_size")

    def status(self) -> str:
        return self._call("status")

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        return self._call("checkpoint_state", step)

    def write(self, directory: str) -> None:
        self._call("write", directory)

    @property
    def failed(self) -> bool:
        if self.runtime.failure is not None:
            return True
        try:
            return bool(self.run(attribute_op, "failed", name="health")[0])
        except WorkerError as exc:
            self.runtime.record_failure(exc)
            raise

    def stop(self) -> None:
        self.shutdown()  # the collector's own stop (bounded) when healthy, then the actor is killed
