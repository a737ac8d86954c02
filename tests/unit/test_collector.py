"""The deterministic trajectory collector (rollouts/collector.py; issue 15, design/async-grpo.md §3.9):
it generates the granted targets in order with the same calls the synchronous step makes, puts
whole groups into the replay buffer tagged with their version, hands its errors to the trainer's
thread, and stops within its deadline. Real components: the built-in task on a local tiny model."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from helpers import small_trainer
from grpo_sdk.core.errors import EnvironmentStepError
from grpo_sdk.plugins import ComponentSpec, EnvironmentReturn, hookimpl
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.rollouts.collector import TrajectoryCollector
from grpo_sdk.rollouts.replay_buffer import ReplayBuffer

P, G, WAIT = 4, 4, 60.0


class Exploding(ReverseDigitsEnvironment):
    def step(self, message_logs, metadata):
        raise RuntimeError("the judge is down")


class Components:
    @hookimpl
    def grpo_components(self):
        return [ComponentSpec(name="exploding", kind="environment", impl=f"{__name__}:Exploding",
                              capabilities={"generates_prompts"})]


pytestmark = pytest.mark.hook_plugin(Components())


def _collector(trainer, max_age: int) -> tuple[TrajectoryCollector, ReplayBuffer, SimpleNamespace]:
    buffer = ReplayBuffer(num_prompts_per_step=P, num_generations=G, max_age=max_age)
    counters = SimpleNamespace(next_group_id=0, reward_failures=[])
    return TrajectoryCollector(trainer.components.step_rollouts, buffer, counters), buffer, counters


def _take(buffer: ReplayBuffer, step: int):
    assert buffer.wait_for(step, timeout=WAIT), f"target {step} never completed"
    taken = buffer.take(step)
    assert taken is not None
    return taken


def test_granted_targets_are_the_sync_steps_rollouts_in_order(registry, tmp_path, tiny_model_dir):
    """Without training in between, the collector's targets 0 and 1 are exactly what two synchronous
    collect calls of a twin trainer give: same prompts, group ids, tokens, logprobs and rewards."""
    trainer = small_trainer(registry, tmp_path / "a", tiny_model_dir)
    twin = small_trainer(registry, tmp_path / "b", tiny_model_dir)
    collector, buffer, counters = _collector(trainer, max_age=1)
    collector.start()
    try:
        collector.grant(1)  # targets 0 .. A at start-up
        taken = [_take(buffer, 0), _take(buffer, 1)]
        collector.drain(timeout=WAIT)
    finally:
        collector.stop()
    assert counters.next_group_id == 2 * P and trainer.state.next_group_id == 0
    for got in taken:
        expected, _ = twin.collect_rollouts()
        twin.state.step += 1
        assert [g.ordinal for g in got.groups] == sorted(set(expected.group_ids.tolist()))
        assert all(g.weight_version == 0 and g.rollouts.batch_size == G for g in got.groups)
        for field in ("prompt_ids", "response_ids", "generation_logprobs", "rewards", "group_ids"):
            assert torch.equal(getattr(got.rollouts, field), getattr(expected, field)), field
        assert got.metrics()["train/avg_trajectory_age"] == got.step - 0


def test_nothing_is_generated_beyond_the_grant(registry, tmp_path, tiny_model_dir):
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir)
    collector, buffer, _ = _collector(trainer, max_age=2)
    collector.start()
    try:
        collector.grant(0)
        _take(buffer, 0)
        collector.drain(timeout=WAIT)
        time.sleep(0.3)  # an ungated collector would be generating target 1 by now
        assert buffer.size == 0 and collector.generated_through == 0
        collector.grant(2)
        collector.drain(timeout=WAIT)
        assert sorted(buffer.targets()) == [1, 2]
    finally:
        collector.stop()


def test_an_error_in_the_collector_reaches_the_trainer_and_the_thread_ends(registry, tmp_path, tiny_model_dir):
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "env.name=exploding")
    collector, buffer, _ = _collector(trainer, max_age=1)
    collector.start()
    try:
        collector.grant(1)
        started = time.monotonic()
        assert not buffer.wait_for(0, timeout=WAIT)  # woken by the failure, long before the timeout
        assert time.monotonic() - started < WAIT / 2
        with pytest.raises(EnvironmentStepError, match="the judge is down"):
            collector.check()
        with pytest.raises(EnvironmentStepError):
            collector.grant(2)
    finally:
        collector.stop()
    assert not any(t.name == "grpo-collector" and t.is_alive() for t in threading.enumerate())


def test_stop_ends_an_idle_collector_at_once(registry, tmp_path, tiny_model_dir):
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir)
    collector, _, _ = _collector(trainer, max_age=1)
    collector.start()
    started = time.monotonic()
    collector.stop()
    assert time.monotonic() - started < 2 and not collector._thread.is_alive()
