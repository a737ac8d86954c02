"""Async GRPO on the Ray runtime (issue 15 items 2, 3 and 8; docs/async.md, "On Ray"): the
trajectory collector runs as an actor next to the generation workers, the deterministic schedule
gives the in-process results, in-flight weight updates land while a generation is in flight on a
Ray generation worker, and a killed collector actor stops the run naming it, its workers gone.

Every test shares the session's local cluster (``helpers.ray_fixtures.ray_cluster``)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from grpo_sdk.core.errors import DataError
from grpo_sdk.plugins.registry import Registry
from grpo_sdk.runtime.deadlines import WorkerError
from helpers import assert_same_results, bare_trainer, train

ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
SHORT = ["grpo.max_num_steps=4", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false"]
RAY = ["cluster.runtime=ray", "policy.generation.colocated.enabled=false"]

needs_ray = pytest.mark.usefixtures("ray_cluster")


def process_gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@needs_ray
def test_the_collector_is_an_actor_and_gives_the_in_process_results(tmp_path):
    """Deterministic A=1: the same seed trains the same steps in-process (a collector thread) and on
    Ray (a collector actor calling the generation and environment actors itself)."""
    from grpo_sdk.rollouts.collector_worker import RemoteCollector

    validated = ["grpo.val_period=2", "grpo.max_val_samples=16"]  # validation pauses the collector actor
    local = train(bare_trainer(tmp_path, "local", *SHORT, *ASYNC, *validated))
    trainer = bare_trainer(tmp_path, "ray", *SHORT, *ASYNC, *RAY, *validated)
    seen, titled = [], []

    def where(step, metrics):
        collector = trainer.async_rollouts.collector
        seen.append((type(collector), collector.workers[0].pid, collector.workers[0].label))
        titled.append(collector.workers[0].pid in collector_processes())

    on_ray = train(trainer, where)
    assert_same_results(local, on_ray)
    assert [m.get("val/accuracy") for m in on_ray] == [m.get("val/accuracy") for m in local]
    assert sum("val/accuracy" in m for m in on_ray) == 2
    kind, pid, label = seen[0]
    assert kind is RemoteCollector and pid not in (None, os.getpid()) and label == f"collector worker 0 (pid {pid})"
    assert all(titled)  # what collector_processes looks for, below
    assert [m["train/avg_trajectory_age"] for m in on_ray] == [0.0, 1.0, 1.0, 1.0]
    assert process_gone(pid)  # shut down with the run


@needs_ray
def test_in_flight_weight_updates_land_on_a_ray_generation_worker(tmp_path, ray_cluster, monkeypatch):
    """Newest + in-flight: the driver pauses the generation worker keep-in-flight, updates its weights
    and resumes it while the collector actor's generate() call is in flight (the worker takes two
    calls at once), so some steps train groups whose tokens came from two versions."""
    monkeypatch.syspath_prepend(str(ray_cluster.site))
    registry = Registry.discover()
    try:
        trainer = bare_trainer(tmp_path, "run", *ASYNC, *RAY, "grpo.async_grpo.schedule=newest",
                              "grpo.async_grpo.in_flight_weight_updates=true",
                              "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true",
                              "grpo.async_grpo.max_trajectory_age_steps=1", "policy.generation.backend=slow-hf",
                              "policy.generation.max_new_tokens=16", "grpo.num_prompts_per_step=4",
                              "grpo.num_generations_per_prompt=8", "grpo.max_num_steps=8", "grpo.val_period=0",
                              "grpo.val_at_end=false", "checkpointing.enabled=false", registry=registry)
        steps = train(trainer)
    finally:
        sys.modules.pop("grpo_test_slow_hf", None)
    assert len(steps) == 8
    mixed = [m for m in steps if m.get("train/in_flight_groups", 0) > 0]
    assert mixed, "no weight update landed in flight"
    for m in mixed:
        assert 0 < m["train/token_age_mean"] <= m["train/avg_trajectory_age"] <= 1
    assert all(0 <= m["train/avg_trajectory_age"] <= 1 for m in steps)


@needs_ray
def test_a_killed_collector_actor_stops_the_run_naming_it_and_the_run_resumes_exactly(tmp_path):
    """SIGKILL of the collector actor after step 3: the run stops with a WorkerError naming it, within
    seconds, every worker of the run gone; resumed from step_2 on Ray, the new collector actor
    restores the buffer that checkpoint holds and steps 3-6 are the uninterrupted run's."""
    args = [*ASYNC, "grpo.max_num_steps=6", "grpo.val_period=0", "grpo.val_at_end=false",
            "checkpointing.save_period=2"]
    uninterrupted = train(bare_trainer(tmp_path, "local", *args))
    trainer = bare_trainer(tmp_path, "run", *args, *RAY)
    pids = {}

    def kill_after_step_3(step, metrics):
        if step == 3:
            collector = trainer.async_rollouts.collector
            pids.update(collector=collector.workers[0].pid, generation=trainer.components.generation.workers[0].pid,
                        policy=trainer.components.policy.workers[0].pid)
            os.kill(pids["collector"], signal.SIGKILL)

    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        train(trainer, kill_after_step_3)
    assert time.monotonic() - start < 120
    assert info.value.worker == f"collector worker 0 (pid {pids['collector']})"
    assert str(info.value).startswith(f"collector worker 0 (pid {pids['collector']}) died during ")
    assert all(process_gone(pid) for pid in pids.values()), pids
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_2"]

    resumed = train(bare_trainer(tmp_path, "run", *args, *RAY, resume=True))
    assert_same_results(uninterrupted[2:], resumed)


REWARD = '''
def reward(prompts, completions, target, **kwargs):
    return [float(c.strip() == t) for c, t in zip(completions, target)]
'''


def collector_processes() -> list[int]:
    """Live processes of collector actors on this machine (Ray titles an actor's process ``ray::Class``)."""
    found = []
    for entry in os.scandir("/proc"):
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::CollectorWorker"):
                    found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


@needs_ray
def test_a_collector_that_cannot_start_stops_the_run_and_leaves_no_worker(tmp_path, ray_cluster, monkeypatch):
    """Seed bug 16: a startup error of the async pipeline left workers running. Here the collector
    actor cannot read the data (deleted after the driver read it): the run stops with the data
    error itself, and every worker of the run, the collector's included, is gone."""
    (ray_cluster.site / "grpo_test_exact_reward.py").write_text(REWARD)  # importable in every worker
    monkeypatch.syspath_prepend(str(ray_cluster.site))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "{n}>", "target": "{str(n)[::-1]}"}}\n' for n in range(1000, 1040)))
    trainer = bare_trainer(tmp_path, "run", *ASYNC, *RAY, *SHORT, f"data.train_path={data}",
                          "env.name=reward_functions", "env.reward_functions.functions=[grpo_test_exact_reward:reward]")
    try:
        trainer.setup()
        parts = trainer.components
        pids = [g.workers[0].pid for g in (parts.policy, parts.generation, parts.environment)]
        data.unlink()
        with pytest.raises(DataError) as info:
            trainer.train()
    finally:
        trainer.shutdown()
        sys.modules.pop("grpo_test_exact_reward", None)
    assert str(info.value) == f"{data}: no such file or directory"
    assert all(process_gone(pid) for pid in pids), pids
    deadline = time.monotonic() + 30
    while collector_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert collector_processes() == []
