"""The async replay buffer: put/take invariants, the age window, threads, and its checkpoint files.

Groups are built directly as small RolloutBatches (no model): one prompt, G responses, padded to
widths wider than the group needs, the way a batch of several prompts pads them.
"""

from __future__ import annotations

import json
import threading
import time

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from grpo_sdk.core.errors import ConfigError, ExitCode
from grpo_sdk.core.records import Message
from grpo_sdk.rollouts.replay_buffer import (
    BUFFER_JSON,
    BUFFER_TENSORS,
    BufferedGroup,
    BufferFileError,
    ReplayBuffer,
    ReplayBufferError,
)
from grpo_sdk.rollouts.rollout import RolloutBatch
from helpers import assert_same_group, assert_same_tensor

PAD = 0


def make_group(ordinal: int, target: int, version: int, *, G: int = 2, last: int | None = None, seed: int = 0,
               prompt_width: int = 7, response_width: int = 6, metadata: dict | None = None, rewards: bool = True,
               token_versions: bool = False, rows: int | None = None) -> BufferedGroup:
    gen = torch.Generator().manual_seed(1000 * seed + ordinal)
    rows = G if rows is None else rows
    prompt = torch.randint(3, 50, (int(torch.randint(1, prompt_width + 1, (1,), generator=gen)),), generator=gen)
    prompt_ids = torch.full((rows, prompt_width), PAD, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
    prompt_ids[:, prompt_width - len(prompt):] = prompt
    prompt_mask[:, prompt_width - len(prompt):] = 1
    lengths = torch.randint(0, response_width + 1, (rows,), generator=gen)
    response_ids = torch.full((rows, response_width), PAD, dtype=torch.long)
    logprobs = torch.zeros((rows, response_width))
    logs = []
    for i in range(rows):
        n = int(lengths[i])
        response_ids[i, :n] = torch.randint(3, 50, (n,), generator=gen)
        logprobs[i, :n] = -torch.rand(n, generator=gen) * 3
        logs.append([Message(role="user", content=f"prompt {ordinal}", token_ids=tuple(prompt.tolist())),
                     Message(role="assistant", content=f"answer {ordinal}.{i}",
                             token_ids=tuple(response_ids[i, :n].tolist()),
                             generation_logprobs=tuple(logprobs[i, :n].tolist()))])
    correct = (torch.rand(rows, generator=gen) > 0.5).float()
    batch = RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_lengths=lengths,
        generation_logprobs=logprobs, truncated=lengths == response_width,
        group_ids=torch.full((rows,), ordinal, dtype=torch.long),
        reward_components={"correct": correct, "format": torch.rand(rows, generator=gen)},
        reward_valid=torch.rand(rows, generator=gen) > 0.2, reward_missing=torch.zeros(rows, dtype=torch.bool),
        message_logs=logs, metadata=[dict(metadata or {"answer": str(ordinal)}) for _ in range(rows)],
        pad_token_id=PAD, weight_version=version,
        rewards=correct * 2 if rewards else None, unshaped_rewards=correct if rewards else None)
    versions = None
    if token_versions:
        versions = torch.full((rows, response_width), version, dtype=torch.long)
        versions[:, response_width // 2:] = version if last is None else last
    return BufferedGroup(ordinal=ordinal, target_step=target, weight_version=version,
                         last_weight_version=version if last is None else last, epoch=ordinal % 3, rollouts=batch,
                         generation_seconds=0.125 * ordinal, attempts=1 + ordinal % 2,
                         token_weight_versions=versions)


def buffer(P=3, G=2, A=1, **kw) -> ReplayBuffer:
    return ReplayBuffer(num_prompts_per_step=P, num_generations=G, max_age=A, **kw)


# -- put / take ------------------------------------------------------------------------------------------------


def test_take_returns_the_steps_groups_sorted_by_ordinal_with_their_age():
    buf = buffer(P=3, A=2)
    for ordinal, target, version in [(12, 5, 5), (10, 5, 3), (13, 6, 4), (11, 5, 4)]:
        buf.put(make_group(ordinal, target, version))
    assert buf.size == 4 and buf.complete(5) and not buf.complete(6)
    taken = buf.take(5)
    assert [g.ordinal for g in taken.groups] == [10, 11, 12]
    assert taken.rollouts.batch_size == 6
    assert taken.rollouts.group_ids.tolist() == [10, 10, 11, 11, 12, 12]
    assert taken.rollouts.weight_version == 3  # the batch's oldest
    expected_logs = [log for o in (10, 11, 12) for log in make_group(o, 5, 0).rollouts.message_logs]
    assert taken.rollouts.message_logs == expected_logs
    assert taken.avg_trajectory_age == pytest.approx(5 - (3 + 4 + 5) / 3)
    assert taken.age_fractions == {0: pytest.approx(1 / 3), 1: pytest.approx(1 / 3), 2: pytest.approx(1 / 3)}
    assert taken.metrics()["train/buffer_size"] == 1.0 and buf.size == 1
    assert taken.metrics()["train/trajectory_age/2"] == pytest.approx(1 / 3)
    assert buf.targets()[6].ordinals == (13,) and 5 not in buf.targets()


def test_short_target_returns_none_and_keeps_its_groups():
    buf = buffer(P=3)
    buf.put(make_group(1, 2, 2))
    buf.put(make_group(2, 2, 1))
    assert buf.take(2) is None
    assert buf.size == 2 and buf.targets()[2].ordinals == (1, 2)
    buf.put(make_group(0, 2, 2))
    assert [g.ordinal for g in buf.take(2).groups] == [0, 1, 2]


def test_bug15_wrong_size_group_refused_at_put_and_nothing_lost():
    """NeMo-RL dropped a wrong-size batch after sampling removed it; here the group is refused
    when it is put, and the groups already there stay until the step is whole."""
    buf = buffer(P=2, G=2)
    buf.put(make_group(0, 1, 1))
    with pytest.raises(ReplayBufferError, match=r"prompt group 1 \(target step 1.*3 rows.*not 2"):
        buf.put(make_group(1, 1, 1, rows=3))
    assert buf.size == 1 and buf.take(1) is None and buf.size == 1
    buf.put(make_group(1, 1, 1))
    assert buf.take(1).rollouts.batch_size == 4 and buf.size == 0


def test_take_that_fails_removes_nothing(monkeypatch):
    buf = buffer(P=2)
    buf.put(make_group(0, 1, 1))
    buf.put(make_group(1, 1, 0))

    def broken(batches):
        raise RuntimeError("concat failed")

    monkeypatch.setattr(RolloutBatch, "concat", staticmethod(broken))
    with pytest.raises(RuntimeError, match="concat failed"):
        buf.take(1)
    monkeypatch.undo()
    assert buf.size == 2 and buf.taken_through is None
    assert [g.ordinal for g in buf.take(1).groups] == [0, 1]


@pytest.mark.parametrize("A, target, version, last", [(1, 5, 3, 3), (1, 5, 6, 6), (0, 5, 4, 4), (2, 5, 4, 3)])
def test_put_refuses_a_group_outside_its_window(A, target, version, last):
    buf = buffer(A=A)
    with pytest.raises(ReplayBufferError, match=rf"prompt group 7 .*outside the window \[{target - A}, {target}\]"):
        buf.put(make_group(7, target, version, last=last))
    assert buf.size == 0


def test_put_accepts_the_window_edges():
    buf = buffer(P=2, A=2)
    buf.put(make_group(0, 5, 3))
    buf.put(make_group(1, 5, 5, last=6))  # newest token may come from later weights (in-flight update)
    assert buf.targets()[5].weight_versions == (3, 5)


def test_put_refuses_broken_invariants_naming_the_group():
    buf = buffer(P=2, A=1)
    buf.put(make_group(0, 1, 1))
    with pytest.raises(ReplayBufferError, match="prompt group 0 .*already holds a group with ordinal 0"):
        buf.put(make_group(0, 2, 1))
    bad_ids = make_group(3, 1, 1)
    bad_ids = attrs.evolve(bad_ids, rollouts=attrs.evolve(bad_ids.rollouts, group_ids=torch.tensor([3, 4])))
    with pytest.raises(ReplayBufferError, match=r"group ids \[3, 4\], not its ordinal 3"):
        buf.put(bad_ids)
    other_pad = make_group(5, 1, 1)
    with pytest.raises(ReplayBufferError, match="pad token id 9"):
        buf.put(attrs.evolve(other_pad, rollouts=attrs.evolve(other_pad.rollouts, pad_token_id=9)))
    buf.put(make_group(1, 1, 0))
    with pytest.raises(ReplayBufferError, match="step 1 already has its 2 groups"):
        buf.put(make_group(2, 1, 1))
    buf.take(1)
    with pytest.raises(ReplayBufferError, match="step 1 was already trained"):
        buf.put(make_group(2, 1, 1))
    with pytest.raises(ReplayBufferError, match="step 1 was already taken"):
        buf.take(1)
    assert buf.size == 0


def test_capacity_is_age_plus_one_steps_of_groups():
    buf = buffer(P=2, A=1)
    assert buf.capacity == 4
    for ordinal, target in [(0, 3), (1, 3), (2, 4), (3, 4)]:
        buf.put(make_group(ordinal, target, 3))
    with pytest.raises(ReplayBufferError, match=r"prompt group 4 .*buffer is full \(4 groups.*targets \[3, 4\]"):
        buf.put(make_group(4, 5, 4))
    assert buf.size == 4
    buf.take(3)
    buf.put(make_group(4, 5, 4))
    assert buf.size == 3


def test_put_stores_the_groups_version_on_its_batch():
    buf = buffer(P=1)
    group = make_group(0, 4, 3)
    buf.put(attrs.evolve(group, rollouts=attrs.evolve(group.rollouts, weight_version=99)))
    assert buf.take(4).rollouts.weight_version == 3


# -- threads -----------------------------------------------------------------------------------------------------


def test_wait_for_times_out_when_nothing_arrives():
    buf = buffer(P=1)
    start = time.monotonic()
    assert buf.wait_for(1, timeout=0.1) is False
    assert 0.09 <= time.monotonic() - start < 2


def test_concurrent_puts_wake_the_waiting_trainer():
    P, steps = 6, 3
    buf = buffer(P=P, A=1)
    errors: list[BaseException] = []

    def collector(worker: int):
        try:
            for step in range(steps):
                for j in range(worker, P, 3):  # three threads share each step's groups
                    deadline = time.monotonic() + 20
                    while step >= 2 and (buf.taken_through or -1) < step - 2:  # capacity: two steps of groups
                        assert time.monotonic() < deadline, "the trainer never took a step"
                        time.sleep(0.001)
                    buf.put(make_group(step * P + j, step, max(step - 1, 0)))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=collector, args=(w,), daemon=True) for w in range(3)]
    for t in threads:
        t.start()
    taken = []
    for step in range(steps):
        deadline = time.monotonic() + 20
        while not buf.wait_for(step, timeout=0.25):
            assert time.monotonic() < deadline and not errors, errors
        taken.append(buf.take(step))
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    assert not errors
    expected = [list(range(s * P, s * P + P)) for s in range(steps)]
    assert [[g.ordinal for g in batch.groups] for batch in taken] == expected
    assert buf.size == 0


def test_wake_ends_a_wait_early():
    buf = buffer(P=1)
    timer = threading.Timer(0.05, buf.wake)
    timer.start()
    start = time.monotonic()
    assert buf.wait_for(1, timeout=20) is False
    assert time.monotonic() - start < 10
    timer.join(timeout=5)


def test_racing_puts_of_one_ordinal_store_it_once():
    buf = buffer(P=4)
    outcomes: list[str] = []
    barrier = threading.Barrier(4, timeout=10)

    def put():
        barrier.wait()
        try:
            buf.put(make_group(7, 1, 1))
            outcomes.append("ok")
        except ReplayBufferError:
            outcomes.append("refused")

    threads = [threading.Thread(target=put, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(outcomes) == ["ok", "refused", "refused", "refused"] and buf.size == 1


# -- checkpoint files --------------------------------------------------------------------------------------------


def filled(P=3, G=2, A=2, step=4) -> ReplayBuffer:
    buf = buffer(P=P, G=G, A=A)
    meta = {"answer": "42", "ids": np.array([1, 2, 3]), "score": np.float32(0.5), "nested": {"n": np.int64(7)},
            "flag": np.bool_(True), "none": None, "list": [1, "a", [2.5]]}
    buf.put(make_group(20, step, step - 2, metadata=meta, token_versions=True, last=step - 1))
    buf.put(make_group(21, step, step, rewards=False))
    buf.put(make_group(22, step + 1, step))
    buf.put(make_group(23, step + 2, step, token_versions=True))
    return buf


def test_round_trip_is_bit_exact(tmp_path):
    buf = filled()
    buf.write(tmp_path)
    document = json.loads((tmp_path / BUFFER_JSON).read_text())  # plain JSON, nothing pickled
    assert document["groups"][0]["metadata"][0] == {"answer": "42", "ids": [1, 2, 3], "score": 0.5,
                                                    "nested": {"n": 7}, "flag": True, "none": None,
                                                    "list": [1, "a", [2.5]]}
    stored = load_file(str(tmp_path / BUFFER_TENSORS))
    assert stored["20/truncated"].dtype == torch.bool and stored["20/reward_valid"].dtype == torch.bool
    group = buf.groups()[0]
    assert stored["20/prompt_ids"].shape[1] == int(group.rollouts.prompt_mask.sum(1).max()) < 7  # trimmed
    assert "21/rewards" not in stored and "20/reward/format" in stored
    restored, dropped = ReplayBuffer.read(tmp_path, step=4, num_prompts_per_step=3, num_generations=2, max_age=2,
                                          schedule="deterministic")
    assert dropped == () and restored.taken_through == 3
    originals = buf.groups()
    assert [g.ordinal for g in restored.groups()] == [20, 21, 22, 23]
    for before, after in zip(originals, restored.groups()):
        if before.ordinal == 20:  # numpy metadata comes back as the values JSON holds
            before = attrs.evolve(before, rollouts=attrs.evolve(
                before.rollouts, metadata=[document["groups"][0]["metadata"][0]] * 2))
        assert_same_group(before, after)


def test_round_trip_keeps_padding_that_is_not_one_constant(tmp_path):
    buf = buffer(P=1, G=3, A=0)
    group = make_group(5, 2, 2, G=3)
    logprobs = group.rollouts.generation_logprobs.clone()
    logprobs[:, -1] = torch.tensor([0.5, float("nan"), -1.0])  # a backend that leaves garbage after the stop
    odd = attrs.evolve(group.rollouts, generation_logprobs=logprobs)
    buf.put(attrs.evolve(group, rollouts=odd))
    buf.write(tmp_path)
    restored, _ = ReplayBuffer.read(tmp_path, step=2, num_prompts_per_step=1, num_generations=3, max_age=0,
                                    schedule="deterministic")
    after = restored.groups()[0].rollouts.generation_logprobs
    assert after.shape == logprobs.shape and torch.equal(after.isnan(), logprobs.isnan())
    assert torch.equal(after.nan_to_num(7.0), logprobs.nan_to_num(7.0))


def test_assistant_turn_that_is_not_the_response_row_is_stored_whole(tmp_path):
    buf = buffer(P=1, G=2, A=0)
    group = make_group(1, 1, 1)
    logs = [[*log, Message(role="assistant", content="edited", token_ids=(4, 5), generation_logprobs=(-0.25, -1.5))]
            for log in group.rollouts.message_logs]
    buf.put(attrs.evolve(group, rollouts=attrs.evolve(group.rollouts, message_logs=logs)))
    buf.write(tmp_path)
    restored, _ = ReplayBuffer.read(tmp_path, step=1, num_prompts_per_step=1, num_generations=2, max_age=0,
                                    schedule="deterministic")
    assert restored.groups()[0].rollouts.message_logs == logs


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), G=st.integers(1, 4), prompt_width=st.integers(1, 6),
       response_width=st.integers(0, 5), rewards=st.booleans(), token_versions=st.booleans())
def test_round_trip_property(tmp_path_factory, seed, G, prompt_width, response_width, rewards, token_versions):
    directory = tmp_path_factory.mktemp("buffer")
    buf = buffer(P=2, G=G, A=1)
    for ordinal in (seed, seed + 1):
        buf.put(make_group(ordinal, 3, 2 + ordinal % 2, G=G, seed=seed, prompt_width=prompt_width,
                           response_width=response_width, rewards=rewards, token_versions=token_versions))
    buf.write(directory)
    restored, _ = ReplayBuffer.read(directory, step=3, num_prompts_per_step=2, num_generations=G, max_age=1,
                                    schedule="deterministic")
    for before, after in zip(buf.groups(), restored.groups(), strict=True):
        assert_same_group(before, after)
    assert_same_tensor(buf.take(3).rollouts.prompt_ids, restored.take(3).rollouts.prompt_ids, "taken prompt_ids")


@pytest.mark.parametrize("value, key", [(object(), "['bad']"), ({1: "x"}, "['bad'][1]"), ([b"raw"], "['bad'][0]")])
def test_metadata_json_cannot_hold_is_a_save_error_naming_the_key(tmp_path, value, key):
    buf = buffer(P=1, A=0)
    buf.put(make_group(3, 1, 1, metadata={"ok": 1, "bad": value}))
    with pytest.raises(BufferFileError, match=r"metadata of row 0 of prompt group 3 .*" + key.replace("[", r"\[")):
        buf.write(tmp_path)
    assert not (tmp_path / BUFFER_JSON).exists()


def test_restore_drops_trained_targets_and_groups_outside_their_window(tmp_path):
    filled(step=4).write(tmp_path)
    document = json.loads((tmp_path / BUFFER_JSON).read_text())
    document["groups"][3]["weight_version"] = 3  # target 6, A=2: window [4, 6]
    (tmp_path / BUFFER_JSON).write_text(json.dumps(document))
    restored, dropped = ReplayBuffer.read(tmp_path, step=5, num_prompts_per_step=3, num_generations=2, max_age=2,
                                          schedule="deterministic")
    assert sorted(dropped) == [20, 21, 23]
    assert [g.ordinal for g in restored.groups()] == [22] and restored.taken_through == 4
    with pytest.raises(ReplayBufferError, match="already trained"):
        restored.put(make_group(30, 4, 4))
    restored.put(make_group(30, 5, 4))  # incomplete targets are kept and filled
    restored.put(make_group(31, 5, 5))
    assert [g.ordinal for g in restored.take(5).groups] == [22, 30, 31]


def test_restore_refuses_a_buffer_saved_with_other_settings(tmp_path):
    filled().write(tmp_path)
    with pytest.raises(ConfigError) as info:
        ReplayBuffer.read(tmp_path, step=4, num_prompts_per_step=4, num_generations=3, max_age=1, schedule="newest")
    assert info.value.exit_code == ExitCode.USAGE
    keys = [key for key, _ in info.value.problems]
    assert keys == ["grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "grpo.async_grpo.schedule",
                    "grpo.async_grpo.max_trajectory_age_steps"]
    assert "saved with 3, this run has 4" in info.value.problems[0][1]
    assert "checkpointing.load_replay_buffer=false" in str(info.value)


def test_damaged_or_missing_files_are_named(tmp_path):
    with pytest.raises(BufferFileError, match="cannot read the replay buffer"):
        ReplayBuffer.read(tmp_path, step=1, num_prompts_per_step=3, num_generations=2, max_age=2,
                          schedule="deterministic")
    filled().write(tmp_path)
    tensors = tmp_path / BUFFER_TENSORS
    tensors.write_bytes(tensors.read_bytes()[:100])
    with pytest.raises(BufferFileError, match="cannot read the replay buffer"):
        ReplayBuffer.read(tmp_path, step=4, num_prompts_per_step=3, num_generations=2, max_age=2,
                          schedule="deterministic")
    filled().write(tmp_path)
    document = json.loads((tmp_path / BUFFER_JSON).read_text())
    document["groups"][1]["ordinal"] = 99  # its tensors are under 21/
    (tmp_path / BUFFER_JSON).write_text(json.dumps(document))
    with pytest.raises(BufferFileError, match=f"group 1 of {BUFFER_JSON} cannot be rebuilt .*99/prompt_ids"):
        ReplayBuffer.read(tmp_path, step=4, num_prompts_per_step=3, num_generations=2, max_age=2,
                          schedule="deterministic")


def test_empty_buffer_round_trips(tmp_path):
    buffer(P=2, A=1).write(tmp_path)
    restored, dropped = ReplayBuffer.read(tmp_path, step=7, num_prompts_per_step=2, num_generations=2, max_age=1,
                                          schedule="deterministic")
    assert restored.size == 0 and dropped == () and restored.taken_through == 6


# -- property: random put orders and versions ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 4), G=st.integers(1, 3), A=st.integers(0, 3), steps=st.integers(1, 5),
       rng=st.randoms(use_true_random=False))
def test_take_returns_exactly_the_claimed_groups(P, G, A, steps, rng):
    """A simulated collector: at weight version s it may finish any group of targets s..s+A whose
    version is <= s, in any order, while the trainer tries to take step s at random moments."""
    ordinals = rng.sample(range(10 * steps * P), steps * P)  # gaps, as dynamic sampling leaves them
    claims = {t: sorted(ordinals[t * P:(t + 1) * P]) for t in range(steps)}
    groups = [make_group(o, t, rng.randint(max(t - A, 0), t), G=G, seed=1) for t, os in claims.items() for o in os]
    buf = buffer(P=P, G=G, A=A)
    seen: list[int] = []
    pending = list(groups)
    for step in range(steps):
        ready = [g for g in pending if g.weight_version <= step]
        rng.shuffle(ready)
        for group in ready:
            if rng.random() < 0.3 and not buf.complete(step):
                assert buf.take(step) is None  # a premature take removes nothing
            buf.put(group)
            pending.remove(group)
        assert buf.size <= buf.capacity
        taken = buf.take(step)
        assert [g.ordinal for g in taken.groups] == claims[step]
        assert all(step - A <= g.weight_version <= step for g in taken.groups)
        assert taken.rollouts.group_ids.tolist() == [o for o in claims[step] for _ in range(G)]
        assert sum(taken.age_fractions.values()) == pytest.approx(1.0)
        seen += [g.ordinal for g in taken.groups]
    assert sorted(seen) == sorted(ordinals) and len(set(seen)) == len(seen) and buf.size == 0 and not pending
