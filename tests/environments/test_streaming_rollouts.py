"""Rollouts stream into scoring (env.max_concurrent_calls, rollouts/streaming.py).

On the tiny model and the hf generation (through ``BatchedGeneration``): one environment call per
group, never more than the bound at once, the batch the same as with one call per turn whatever
order the calls return in; a failing group masked or named; a hung call stopped at its deadline;
and, with a backend that returns requests one at a time (as a continuous-batching engine does),
groups scored while others still wait for their samples.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import ClassVar

import pytest
import torch

from helpers import small_trainer

from grpo_sdk.core.errors import EnvironmentStepError
from grpo_sdk.data.prompts import Prompt
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.plugins import ComponentSpec, EnvironmentReturn, Message, hookimpl
from grpo_sdk.rollouts.rollout import collect_rollouts
from grpo_sdk.rollouts.streaming import BatchedGeneration, row_seed


class Calls:
    """What the environments below saw: calls, their sizes, the most in flight at once."""

    lock = threading.Lock()
    in_flight = 0
    most = 0
    sizes: ClassVar[list[int]] = []

    @classmethod
    def reset(cls):
        cls.in_flight, cls.most, cls.sizes = 0, 0, []


class SlowReverse(ReverseDigitsEnvironment):
    """reverse_digits behind a judge that takes 0.2 s a call; the first prompt of each batch of
    prompts takes longest, so calls return out of order. Prompt 1 of a batch is marked ``odd``."""

    def sample_prompts(self, num_prompts, rng):
        prompts = super().sample_prompts(num_prompts, rng)
        return [(text, {**meta, "odd": i == 1, "slow": i == 0}) for i, (text, meta) in enumerate(prompts)]

    def step(self, message_logs, metadata):
        with Calls.lock:
            Calls.in_flight += 1
            Calls.most = max(Calls.most, Calls.in_flight)
            Calls.sizes.append(len(message_logs))
        try:
            self.wait(metadata)
            ret = super().step(message_logs, metadata)
            return type(ret)(rewards=ret.rewards, metrics={**ret.metrics, "calls": 1.0})
        finally:
            with Calls.lock:
                Calls.in_flight -= 1

    def wait(self, metadata):
        time.sleep(0.3 if any(m["slow"] for m in metadata) else 0.2)


class FailingOdd(SlowReverse):
    def wait(self, metadata):
        if any(m["odd"] for m in metadata):
            raise ValueError("the judge cannot read this one")


class HangingOdd(SlowReverse):
    def wait(self, metadata):
        time.sleep(4.0 if any(m["odd"] for m in metadata) else 0.0)


class AsyncSlowReverse(SlowReverse):
    """``async def step``: a judge awaited for 0.2 s a call (odd: 30 s, cancelled at the deadline)."""

    cancelled: ClassVar[list[bool]] = []

    async def step(self, message_logs, metadata):
        with Calls.lock:
            Calls.in_flight += 1
            Calls.most = max(Calls.most, Calls.in_flight)
            Calls.sizes.append(len(message_logs))
        try:
            await asyncio.sleep(30.0 if self.hangs and any(m["odd"] for m in metadata) else 0.2)
            return ReverseDigitsEnvironment.step(self, message_logs, metadata)
        except asyncio.CancelledError:
            AsyncSlowReverse.cancelled.append(True)
            raise
        finally:
            with Calls.lock:
                Calls.in_flight -= 1

    hangs = False


class AsyncHangingOdd(AsyncSlowReverse):
    hangs = True


class TwoTurns(ReverseDigitsEnvironment):
    """Two assistant turns: the first answered with "=1>", each scoring its digits / 10."""

    def step(self, message_logs, metadata):
        turns = [m.get("turn", 0) + 1 for m in metadata]
        return EnvironmentReturn(rewards={"digits": [sum(c.isdigit() for c in log[-1].content) / 10
                                                     for log in message_logs]},
                                 done=[t >= 2 for t in turns], observations=[Message(role="tool", content="=1>")] * len(turns),
                                 metadata=[{**m, "turn": t} for m, t in zip(metadata, turns)])


class Components:
    @hookimpl
    def grpo_components(self):
        return [ComponentSpec(name=name, kind="environment", impl=f"{__name__}:{impl}",
                              capabilities={"generates_prompts", "multi_turn"})
                for name, impl in (("slow_reverse", "SlowReverse"), ("failing_odd", "FailingOdd"),
                                   ("hanging_odd", "HangingOdd"), ("two_turns", "TwoTurns"),
                                   ("async_slow", "AsyncSlowReverse"), ("async_hanging", "AsyncHangingOdd"))]


pytestmark = pytest.mark.hook_plugin(Components())


def rollouts(registry, tmp_path, model_dir, *overrides, name="run"):
    Calls.reset()
    trainer = small_trainer(registry, tmp_path / name, model_dir, "env.name=slow_reverse", *overrides)
    try:
        return trainer.collect_rollouts()
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("bound", [2, 4])
def test_one_call_per_group_at_most_the_bound_at_once(registry, tmp_path, tiny_model_dir, bound):
    # The whole-batch loop returns every group at once, so how many calls overlap is the pool's doing
    rollouts(registry, tmp_path, tiny_model_dir, f"env.max_concurrent_calls={bound}",
             "policy.generation.hf.continuous_batching=false")
    assert Calls.sizes == [4, 4, 4, 4]  # 4 groups of 4 samples: a call each
    assert Calls.most == bound  # 4 calls of 0.2 s took 4 / bound latencies, not 4


def test_the_whole_batch_hf_loop_is_driven_through_batched_generation(registry, tmp_path, tiny_model_dir):
    batch, _ = rollouts(registry, tmp_path, tiny_model_dir, "env.max_concurrent_calls=4",
                        "policy.generation.hf.continuous_batching=false")
    assert Calls.sizes == [4, 4, 4, 4] and batch.batch_size == 16


def test_concurrent_calls_give_the_batch_one_call_gives(registry, tmp_path, tiny_model_dir):
    """Calls returning out of order (the first group's is slowest) change nothing: rows, rewards,
    components, metrics (weighted by samples) and logs are those of one call for the whole batch."""
    serial, serial_metrics = rollouts(registry, tmp_path, tiny_model_dir, "env.max_concurrent_calls=0", name="a")
    assert Calls.sizes == [16]
    pooled, pooled_metrics = rollouts(registry, tmp_path, tiny_model_dir, "env.max_concurrent_calls=3", name="b")
    assert Calls.sizes == [4, 4, 4, 4]
    for field in ("response_ids", "response_lengths", "generation_logprobs", "group_ids", "reward_valid", "rewards"):
        assert torch.equal(getattr(serial, field), getattr(pooled, field)), field
    assert serial.reward_components.keys() == pooled.reward_components.keys() == {"correct_digits"}
    assert torch.equal(serial.reward_components["correct_digits"], pooled.reward_components["correct_digits"])
    assert [[m.content for m in log] for log in serial.message_logs] == \
        [[m.content for m in log] for log in pooled.message_logs]
    assert serial_metrics.keys() == pooled_metrics.keys()
    for key in serial_metrics:
        assert serial_metrics[key] == pytest.approx(pooled_metrics[key]), key
    assert pooled_metrics["env/calls"] == 1.0


def test_a_failing_group_is_masked_or_named(registry, tmp_path, tiny_model_dir):
    batch, _ = rollouts(registry, tmp_path, tiny_model_dir, "env.name=failing_odd", "env.max_concurrent_calls=4",
                        "env.on_reward_error=mask", name="mask")
    odd = torch.tensor([m["odd"] for m in batch.metadata])
    assert int(odd.sum()) == 4 and not bool(batch.reward_valid[odd].any()) and bool(batch.reward_valid[~odd].all())
    assert list(batch.reward_components) == ["correct_digits"]  # the failed group names no "reward" of its own
    with pytest.raises(EnvironmentStepError, match=r"failing_odd.*failed on sample 0 .*cannot read this one"):
        rollouts(registry, tmp_path, tiny_model_dir, "env.name=failing_odd", "env.max_concurrent_calls=4",
                 name="raise")


def test_a_hung_call_stops_the_rollout_at_its_deadline_naming_the_sample(registry, tmp_path, tiny_model_dir):
    start = time.monotonic()
    with pytest.raises(EnvironmentStepError, match=r"hanging_odd.*did not return a reward for sample 0 .*within 1 s"):
        rollouts(registry, tmp_path, tiny_model_dir, "env.name=hanging_odd", "env.max_concurrent_calls=4",
                 "cluster.call_timeout_s=1")
    assert time.monotonic() - start < 30  # the group's call, then its first sample alone: 2 deadlines, plus set-up


def test_an_async_environment_is_awaited_its_calls_interleaving_on_one_loop(registry, tmp_path, tiny_model_dir):
    """``async def step``: the batch is the sync environment's, and the bound's calls are awaited at
    once (4 calls of 0.2 s overlap on the process's event loop)."""
    sync, _ = rollouts(registry, tmp_path, tiny_model_dir, "env.max_concurrent_calls=4",
                       "policy.generation.hf.continuous_batching=false", name="sync")
    one_call, _ = rollouts(registry, tmp_path, tiny_model_dir, "env.name=async_slow", "env.max_concurrent_calls=0",
                           "policy.generation.hf.continuous_batching=false", name="one")
    assert Calls.sizes == [16]
    pooled, _ = rollouts(registry, tmp_path, tiny_model_dir, "env.name=async_slow", "env.max_concurrent_calls=4",
                         "policy.generation.hf.continuous_batching=false", name="pooled")
    assert Calls.sizes == [4, 4, 4, 4] and Calls.most == 4
    for batch in (one_call, pooled):
        for field in ("response_ids", "rewards", "reward_valid"):
            assert torch.equal(getattr(sync, field), getattr(batch, field)), field


def test_an_async_call_past_its_deadline_is_cancelled_and_names_the_sample(registry, tmp_path, tiny_model_dir):
    AsyncSlowReverse.cancelled.clear()
    start = time.monotonic()
    with pytest.raises(EnvironmentStepError, match=r"async_hanging.*did not return a reward for sample 0 .*within 1 s"):
        rollouts(registry, tmp_path, tiny_model_dir, "env.name=async_hanging", "env.max_concurrent_calls=4",
                 "cluster.call_timeout_s=1")
    assert time.monotonic() - start < 30  # the group's call, then its first sample alone: 2 deadlines, plus set-up
    deadline = time.monotonic() + 5
    while len(AsyncSlowReverse.cancelled) < 2 and time.monotonic() < deadline:  # cancellation lands on the loop
        time.sleep(0.05)
    assert len(AsyncSlowReverse.cancelled) == 2  # the group's call and the sample's: neither left running


def test_a_ray_environment_worker_awaits_an_async_step():
    """On Ray an environment actor's ``call`` returns what Ray can send back: the awaited result, not a
    coroutine (the worker class itself, outside Ray: what its actor runs)."""
    from grpo_sdk.runtime.workers import ComponentWorker

    worker = ComponentWorker()
    worker.component = AsyncSlowReverse(None, None)
    log = [Message(role="user", content="12345>"), Message(role="assistant", content="54321")]
    ret = worker.call("step", [log], [{"target": "54321", "odd": False, "slow": False}])
    assert isinstance(ret, EnvironmentReturn) and ret.rewards["correct_digits"] == [1.0]


class OneAtATime(BatchedGeneration):
    """An ``AsyncGeneration`` that finishes one request per poll, the newest first (a continuous-
    batching engine finishing short requests early); it records what was still waiting when each
    environment call started."""

    def __init__(self, generation, pad_token_id, delay_s=0.0):
        super().__init__(generation, pad_token_id)
        self.seeds, self.delay_s, self.early_turns = [], delay_s, []
        self.unreturned = 0  # submitted, not yet returned (read from the environment's threads)

    def submit(self, request_id, prompts, sampling):
        if not request_id.endswith("/1"):  # a later turn: how many first turns still wait
            self.early_turns.append(sum(r.endswith("/1") for r in self.waiting))
        self.unreturned += 1
        super().submit(request_id, prompts, sampling)

    def poll(self, timeout_s):
        if not self.waiting:
            return []
        time.sleep(self.delay_s)
        newest = max(self.waiting)
        self.seeds.append(self.waiting[newest][0].seeds.tolist())
        kept, self.waiting = self.waiting, {newest: self.waiting[newest]}
        try:
            out = super().poll(timeout_s)
        finally:
            self.waiting = {k: v for k, v in kept.items() if k != newest}
        self.unreturned -= len(out)
        return out

    def prepare_for_generation(self):
        self.generation.prepare_for_generation()

    def finish_generation(self):
        self.generation.finish_generation()


def test_a_streaming_backend_has_groups_scored_while_others_wait(registry, tmp_path, tiny_model_dir):
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "env.name=slow_reverse",
                            "env.max_concurrent_calls=4")
    parts, cfg = trainer.components, trainer.config
    Calls.reset()
    engine = OneAtATime(parts.generation, parts.tokenizer.pad_token_id, delay_s=0.1)
    waiting_at_call = []
    step = parts.environment.component.step

    def recording(logs, metadata):
        waiting_at_call.append(engine.unreturned)
        return step(logs, metadata)

    parts.environment.component.step = recording
    prompts = parts.environment.sample_prompts(4, random.Random(0))
    prompts = [Prompt(text=text, metadata=meta, source=f"prompt {i}") for i, (text, meta) in enumerate(prompts)]
    batch, _ = collect_rollouts(prompts=prompts, tokenizer=parts.tokenizer, generation=engine,
                                environment=parts.environment, cfg=cfg, sampling=parts.sampling,
                                max_prompt_tokens=parts.max_prompt_tokens, group_offset=8)
    trainer.shutdown()
    assert waiting_at_call[0] == 3  # the first group returned was scored while three still waited
    assert batch.group_ids.tolist() == [g for g in range(8, 12) for _ in range(4)]  # the episodes' order
    assert [log[0].content for log in batch.message_logs[::4]] == [p.text for p in prompts]
    for log, meta, reward in zip(batch.message_logs, batch.metadata, batch.reward_components["correct_digits"]):
        expected = ReverseDigitsEnvironment(None, None).step([log], [meta]).rewards["correct_digits"][0]
        assert float(reward) == pytest.approx(expected)
    # The rows come from four outputs, returned last group first, each put back in its place
    for i, log in enumerate(batch.message_logs):
        n = int(batch.response_lengths[i])
        assert batch.response_ids[i, :n].tolist() == list(log[-1].token_ids)
        assert batch.generation_logprobs[i, :n].tolist() == pytest.approx(list(log[-1].generation_logprobs))
        assert bool((batch.response_ids[i, n:] == parts.tokenizer.pad_token_id).all())
    # Each row's seed is its own: the run's seed, its global group, its place in the group, the turn
    assert engine.seeds[0] == [row_seed(cfg.grpo.seed, 11, i, 1) for i in range(4)]


def test_a_multi_turn_group_goes_on_as_soon_as_its_call_returns(registry, tmp_path, tiny_model_dir):
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "env.name=two_turns",
                            "env.max_concurrent_calls=4", "grpo.max_rollout_turns=3",
                            "policy.generation.max_new_tokens=4", "policy.max_total_sequence_length=64")
    parts, cfg = trainer.components, trainer.config
    engine = OneAtATime(parts.generation, parts.tokenizer.pad_token_id, delay_s=0.1)
    prompts = [Prompt(text=text, metadata=meta, source=f"prompt {i}")
               for i, (text, meta) in enumerate(parts.environment.sample_prompts(4, random.Random(0)))]
    batch, _ = collect_rollouts(prompts=prompts, tokenizer=parts.tokenizer, generation=engine,
                                environment=parts.environment, cfg=cfg, sampling=parts.sampling,
                                max_prompt_tokens=parts.max_prompt_tokens, group_offset=0)
    trainer.shutdown()
    assert max(engine.early_turns) > 0  # a second turn was asked for while first turns still waited
    assert [log[0].content for log in batch.message_logs[::4]] == [p.text for p in prompts]
    for i, log in enumerate(batch.message_logs):
        turns = [m.content for m in log if m.generation_logprobs is not None]
        assert len(turns) == 2 and batch.metadata[i]["turn"] == 2
        assert float(batch.reward_components["digits"][i]) == pytest.approx(
            sum(sum(c.isdigit() for c in t) / 10 for t in turns))
