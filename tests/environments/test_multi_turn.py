"""Multi-turn episodes, token in and token out (docs/multi-turn.md).

A test environment answers every assistant turn with an observation for a few turns; on the
tiny model (plain text and a chat template built here) these tests check that the train
sequence is what the generation backend saw, turn by turn, that the policy's logprobs of the
final sequence equal the generation logprobs at every assistant token, that only assistant
tokens are trained, and the limits: turns, length, failures, flags.
"""

from __future__ import annotations

import shutil

import attrs
import pytest
import torch

from helpers import assert_same_group, small_trainer

from grpo_sdk.core.errors import EnvironmentStepError
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.plugins import ComponentSpec, EnvironmentReturn, Message, hookimpl
from grpo_sdk.rollouts.collector import split_groups
from grpo_sdk.rollouts.episodes import response_messages
from grpo_sdk.rollouts.replay_buffer import ReplayBuffer

TURNS = 4  # the test environment ends an episode after this many assistant turns


class CountingTurns(ReverseDigitsEnvironment):
    """Answers turn k with the observation "=k>" until turn TURNS; every turn scores the number of
    digits the assistant wrote / 10, so the episode's reward is the sum over its turns. A turn
    with an "a" in it is flagged invalid_tool_call. The turn count lives in the metadata."""

    fail_on_turn: int | None = None

    def tool_schemas(self):
        return []  # it flags "invalid_tool_call" but offers no tool: nothing to render

    def step(self, message_logs, metadata):
        rewards, done, observations, meta, flags = [], [], [], [], []
        for log, m in zip(message_logs, metadata):
            turn = m.get("turn", 0) + 1
            if turn == self.fail_on_turn and "7" in log[-1].content:
                raise ValueError("the judge cannot read a 7")
            rewards.append(sum(c.isdigit() for c in log[-1].content) / 10)
            done.append(turn >= TURNS)
            observations.append(Message(role="tool", content=f"={turn}>"))
            meta.append({**m, "turn": turn})
            flags.append(("invalid_tool_call",) if "a" in log[-1].content else ())
        return EnvironmentReturn(rewards={"digits": rewards}, done=done, observations=observations, metadata=meta,
                                 flags=flags, metrics={"turn": sum(m.get("turn", 0) + 1 for m in metadata) / len(metadata)})


class FailingTurns(CountingTurns):
    fail_on_turn = 2


class Components:
    @hookimpl
    def grpo_components(self):
        return [ComponentSpec(name=name, kind="environment", impl=f"{__name__}:{impl}",
                              capabilities={"generates_prompts", "multi_turn", "tool_calls"})
                for name, impl in (("counting_turns", "CountingTurns"), ("failing_turns", "FailingTurns"))]


pytestmark = pytest.mark.hook_plugin(Components())

MULTI = ["env.name=counting_turns", f"grpo.max_rollout_turns={TURNS + 2}", "policy.generation.max_new_tokens=4",
         "policy.max_total_sequence_length=64"]
# The character tokenizer has no chat template; this one uses only its own characters and tokens:
# a user turn ends with ">", an assistant turn with <eos>, any other turn is "=content>", and the
# generation prompt is "a" (so an environment turn carries template text around its content).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}>"
            "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% else %}={{ m['content'] }}>"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}a{% endif %}")


def multi_turn_trainer(registry, tmp_path, model_dir, *overrides):
    return small_trainer(registry, tmp_path / "run", model_dir, *MULTI, *overrides)


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with TEMPLATE as its tokenizer's chat template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_chat")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def recorded_contexts(trainer):
    """Wrap the run's generation so every row of every generate call is recorded, unpadded."""
    generation, seen = trainer.components.generation, []
    generate = generation.generate

    def recording(prompts, sampling):
        for ids, mask in zip(prompts.input_ids, prompts.attention_mask):
            seen.append(ids[mask.bool()].tolist())
        return generate(prompts, sampling)

    generation.generate = recording
    if hasattr(generation, "submit"):  # a streaming backend: the rollout submits requests
        submit = generation.submit

        def recording_submit(request_id, prompts, sampling):
            for ids, mask in zip(prompts.input_ids, prompts.attention_mask):
                seen.append(ids[mask.bool()].tolist())
            return submit(request_id, prompts, sampling)

        generation.submit = recording_submit
    return seen


def rows_of(batch):
    train = batch.to_train_batch(torch.ones(batch.batch_size))
    for i in range(batch.batch_size):
        keep = train.attention_mask[i].bool()
        yield train.input_ids[i][keep].tolist(), train.token_mask[i][keep].bool().tolist(), batch.message_logs[i]


@pytest.mark.parametrize("chat", [False, True])
def test_the_train_sequence_is_what_generation_saw_turn_by_turn(registry, tmp_path, tiny_model_dir, chat_model_dir,
                                                                chat):
    model = chat_model_dir if chat else tiny_model_dir
    trainer = multi_turn_trainer(registry, tmp_path, model, *(["data.use_chat_template=true"] if chat else []))
    seen = recorded_contexts(trainer)
    batch, metrics = trainer.collect_rollouts()
    tokenizer = trainer.components.tokenizer
    contexts = set(map(tuple, seen))
    for sequence, trained, log in rows_of(batch):
        generated = [m for m in response_messages(log) if m.generation_logprobs is not None]
        assert len(generated) == TURNS  # the environment ended every episode, not a limit
        # every turn was generated from exactly the tokens before it in the final sequence
        prompt = len(sequence) - sum(len(m.token_ids) for m in response_messages(log))
        offset = prompt
        for message in response_messages(log):
            if message.generation_logprobs is not None:
                assert tuple(sequence[:offset]) in contexts
                assert all(trained[offset:offset + len(message.token_ids)])
            else:
                assert not any(trained[offset:offset + len(message.token_ids)])  # environment tokens: no loss
            assert sequence[offset:offset + len(message.token_ids)] == list(message.token_ids)
            offset += len(message.token_ids)
        assert offset == len(sequence) and not any(trained[:prompt])
        # each environment turn is its content, tokenised once (chat: inside the template's text)
        for k, message in enumerate(m for m in response_messages(log) if m.role == "tool"):
            text = tokenizer.decode(message.token_ids)
            if chat:  # the template closes an assistant turn that did not sample <eos> itself, and opens the next
                stopped = generated[k].token_ids[-1] == tokenizer.eos_token_id
                assert text == ("" if stopped else "<eos>") + f"=={k + 1}>>a"  # "=" content ">", then "a"
            else:
                assert text == f"={k + 1}>"
    # each call's metrics weigh by the episodes it stepped: every episode saw turns 1..4
    assert metrics["episode/turns_mean"] == TURNS and metrics["env/turn"] == pytest.approx(2.5)


def test_policy_logprobs_equal_generation_logprobs_at_every_assistant_token(registry, tmp_path, chat_model_dir):
    trainer = multi_turn_trainer(registry, tmp_path, chat_model_dir, "data.use_chat_template=true")
    batch, _ = trainer.collect_rollouts()
    train = batch.to_train_batch(torch.ones(batch.batch_size))
    logprobs = trainer.components.policy.logprobs(train)
    mask = train.token_mask.bool()
    assert int(mask.sum()) == sum(len(m.token_ids) for log in batch.message_logs for m in log
                                  if m.generation_logprobs is not None)
    error = (logprobs - train.generation_logprobs)[mask].abs().max()
    assert error < 1e-4, f"max |policy - generation| logprob = {error:.2e} over {TURNS} turns"


def test_episode_reward_is_the_sum_of_its_turns(registry, tmp_path, tiny_model_dir):
    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir)
    batch, metrics = trainer.collect_rollouts()
    for i, log in enumerate(batch.message_logs):
        turns = [m.content for m in log if m.generation_logprobs is not None]
        assert batch.reward_components["digits"][i].item() == pytest.approx(
            sum(sum(c.isdigit() for c in t) / 10 for t in turns), abs=1e-6)
    assert batch.reward_valid.all()
    assert metrics["response_length/mean"] == pytest.approx(float(batch.sampled.sum(1).float().mean()))


@pytest.mark.parametrize("overrides", [(), ("env.name=failing_turns", "env.on_reward_error=mask",
                                                "env.max_failed_fraction=1.0")])
def test_groups_scored_concurrently_play_the_episodes_one_call_per_turn_plays(registry, tmp_path, tiny_model_dir,
                                                                              overrides):
    """env.max_concurrent_calls=3: one call per group, each group's next turn generated once every
    call of the turn has returned (the hf generation is not a streaming engine, so its batches, and
    its random draws, stay those of one call per turn): the same episodes, rewards and failures."""
    batches = []
    for bound in (0, 3):
        trainer = multi_turn_trainer(registry, tmp_path / str(bound), tiny_model_dir, *overrides,
                                     f"env.max_concurrent_calls={bound}", "policy.max_total_sequence_length=30")
        batches.append(trainer.collect_rollouts())
        trainer.shutdown()
    (serial, serial_metrics), (pooled, pooled_metrics) = batches
    for field in ("response_ids", "response_lengths", "generated_mask", "truncated", "reward_valid", "rewards"):
        assert torch.equal(getattr(serial, field), getattr(pooled, field)), field
    # A streaming backend decodes a row in other batches (and from a prefix cache) when groups go on
    # at their own pace: the same tokens (per-row seeds), logprobs equal up to float rounding.
    torch.testing.assert_close(serial.generation_logprobs, pooled.generation_logprobs, rtol=0, atol=1e-4)
    assert [[(m.content, m.flags) for m in log] for log in serial.message_logs] == \
        [[(m.content, m.flags) for m in log] for log in pooled.message_logs]
    assert serial.metadata == pooled.metadata
    # A call that fails reports no metrics: one call per turn loses the whole turn's, a call per group
    # only the failing group's, so the environment's own metrics agree only when nothing fails.
    kept = (lambda metrics: metrics) if not overrides else (
        lambda metrics: {k: v for k, v in metrics.items() if not k.startswith("env/")})
    assert kept(serial_metrics) == pytest.approx(kept(pooled_metrics))
    assert serial_metrics["episode/turns_max"] > 1
    if overrides:
        assert not bool(serial.reward_valid.all()) and bool(serial.reward_valid.any())


def test_turn_limit_ends_episodes(registry, tmp_path, tiny_model_dir):
    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir, "grpo.max_rollout_turns=2")
    batch, metrics = trainer.collect_rollouts()
    assert all(sum(m.generation_logprobs is not None for m in log) == 2 for log in batch.message_logs)
    assert all(log[-1].role == "assistant" for log in batch.message_logs)  # no observation after the last turn
    assert metrics["episode/turns_max"] == 2


def test_length_limit_truncates_episodes(registry, tmp_path, tiny_model_dir):
    # prompt 7 tokens + turn 4 + "=1>" 3 + turn 4 + "=2>" 3 = 21: the third turn has 1 token of room
    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir, "policy.max_total_sequence_length=22")
    batch, _ = trainer.collect_rollouts()
    lengths = batch.prompt_mask.sum(1) + batch.response_lengths
    assert int(lengths.max()) <= 22
    eos = trainer.components.tokenizer.eos_token_id
    for i, log in enumerate(batch.message_logs):
        assert log[-1].role == "assistant"
        if sum(m.generation_logprobs is not None for m in log) < TURNS:  # ended by the room, not the environment
            assert lengths[i] + len("=k>") >= 22
            assert batch.truncated[i] == (lengths[i] < 22 or log[-1].token_ids[-1] != eos)
    assert batch.truncated.any()


def test_a_failing_turn_is_masked_or_stops_the_run_naming_the_sample(registry, tmp_path, tiny_model_dir):
    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir, "env.name=failing_turns", "env.on_reward_error=mask",
                          "env.max_failed_fraction=1.0")
    batch, _ = trainer.collect_rollouts()
    failed = ~batch.reward_valid
    for i, log in enumerate(batch.message_logs):
        turns = [m.content for m in log if m.generation_logprobs is not None]
        assert bool(failed[i]) == (len(turns) >= 2 and "7" in turns[1])
        if failed[i]:
            assert len(turns) == 2  # the failed episode ends there
    trainer = multi_turn_trainer(registry, tmp_path / "raise", tiny_model_dir, "env.name=failing_turns")
    with pytest.raises(EnvironmentStepError, match=r"failed on sample \d+ .*cannot read a 7"):
        for _ in range(20):  # some episode writes a 7 in its second turn within a few batches
            trainer.collect_rollouts()


def test_flagged_turns_take_the_configured_advantage(registry, tmp_path, tiny_model_dir):
    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir, "grpo.invalid_tool_call_advantage=-5.0")
    metrics, rollouts = trainer.train_step()
    flagged = sum("invalid_tool_call" in m.flags for log in rollouts.message_logs for m in log)
    turns = sum(m.generation_logprobs is not None for log in rollouts.message_logs for m in log)
    assert flagged > 0 and metrics["num_invalid_tool_calls"] == flagged
    assert metrics["invalid_tool_call_rate"] == pytest.approx(flagged / turns)
    assert metrics["episode/invalid_tool_call_rate"] == pytest.approx(flagged / turns)


def test_override_covers_exactly_the_flagged_turns_tokens(registry, tmp_path, tiny_model_dir):
    from grpo_sdk.rollouts.episodes import override_turn_advantages

    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir)
    batch, _ = trainer.collect_rollouts()
    advantages = torch.ones(batch.batch_size, 1).expand(-1, batch.prompt_ids.shape[1] + batch.response_ids.shape[1])
    grpo = attrs.evolve(trainer.config.grpo, invalid_tool_call_advantage=-5.0)
    out, _ = override_turn_advantages(advantages, batch.to_train_batch(batch.reward_valid.float()), grpo)
    assert advantages.eq(1).all()  # the estimator's (broadcast) tensor is not written into
    for i, log in enumerate(batch.message_logs):
        column = batch.prompt_ids.shape[1]
        for message in response_messages(log):
            span = out[i, column:column + len(message.token_ids)]
            expected = -5.0 if "invalid_tool_call" in message.flags else 1.0
            assert span.eq(expected).all(), (message, span)
            column += len(message.token_ids)


def test_multi_turn_groups_round_trip_through_the_replay_buffer(registry, tmp_path, tiny_model_dir):
    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir)
    batch, _ = trainer.collect_rollouts()
    trainer.components.step_rollouts.process_rewards(batch)
    buffer = ReplayBuffer(num_prompts_per_step=4, num_generations=4, max_age=1)
    for group in split_groups(batch, 1, epoch=0):
        buffer.put(group)
    buffer.write(tmp_path / "buffer")
    restored, _ = ReplayBuffer.read(tmp_path / "buffer", step=0, num_prompts_per_step=4, num_generations=4,
                                    max_age=1, schedule="deterministic")
    assert any(m.flags for g in restored.groups() for log in g.rollouts.message_logs for m in log)
    for before, after in zip(buffer.groups(), restored.groups()):
        assert_same_group(before, after)
        assert torch.equal(before.rollouts.sampled, after.rollouts.sampled)


def test_malformed_thinking_is_flagged_on_any_episode_and_overridden(registry, tmp_path, tiny_model_dir):
    # think tags from the character vocabulary: a turn that writes the open tag "a" is malformed
    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir, "grpo.malformed_thinking_advantage=-2.0",
                          'reward_penalties.thinking_tags=["a","b"]')
    metrics, rollouts = trainer.train_step()
    turns = [m for log in rollouts.message_logs for m in log if m.generation_logprobs is not None]
    assert any("a" in m.content for m in turns)
    for m in turns:
        assert ("malformed_thinking" in m.flags) == ("a" in m.content or m.content.count("b") > 1)
    assert metrics["num_malformed_thinking"] == sum("malformed_thinking" in m.flags for m in turns)


def test_override_needs_an_environment_that_flags_tool_calls(registry, tmp_path, tiny_model_dir):
    from helpers import config_problems

    problems = config_problems(registry, "grpo.invalid_tool_call_advantage=-5")
    assert "does not flag invalid tool calls" in problems["grpo.invalid_tool_call_advantage"]


def test_a_multi_turn_environment_with_one_turn_warns(registry, caplog):
    from grpo_sdk.config.loading import load_config

    with caplog.at_level("WARNING"):
        load_config(None, ["env.name=counting_turns"], registry)
    assert "every episode ends after its first assistant turn" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_config(None, ["env.name=counting_turns", "grpo.max_rollout_turns=3"], registry)
    assert "first assistant turn" not in caplog.text


def test_validation_plays_whole_episodes(registry, tmp_path, tiny_model_dir):
    trainer = multi_turn_trainer(registry, tmp_path, tiny_model_dir, "grpo.max_val_samples=8")
    metrics, batches = trainer.validate(0)
    assert metrics["episode/turns_mean"] == TURNS and metrics["num_samples"] == 8
    generated = sum(len(m.token_ids) for b in batches for log in b.message_logs for m in log
                    if m.generation_logprobs is not None)
    assert metrics["avg_length"] == pytest.approx(generated / 8)  # the model's tokens, not the tool's
    again, _ = trainer.validate(0)
    assert again == metrics  # a fixed seed per turn: the same weights give the same numbers


def test_a_template_that_cannot_render_the_environments_turn_is_named(tiny_model_dir):
    from transformers import AutoTokenizer

    from grpo_sdk.core.errors import GrpoSdkError
    from grpo_sdk.rollouts.episodes import EnvironmentTurns

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                               "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}"
                               "{% endfor %}")
    turns = EnvironmentTurns(tokenizer)
    assert tokenizer.decode(turns.encode([([Message(role="user", content="1")], None, True)])[0]) == "1"
    with pytest.raises(GrpoSdkError, match=r"cannot render the environment's turn \(roles 'tool'\).*unknown role tool"):
        turns.encode([([Message(role="tool", content="1")], None, True)])
    # a template that rewrites what came before once a message follows cannot be continued token for token
    tokenizer.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(GrpoSdkError, match="rewrites earlier turns"):
        EnvironmentTurns(tokenizer).encode([([Message(role="user", content="1")], None, True)])


def test_a_single_turn_batch_takes_the_generations_tensors_as_the_lists_would_build_them(
        registry, tmp_path, tiny_model_dir):
    """Single-turn, ``batch_of`` takes the response rows straight from the GenerationOutput; built
    from the episodes' token lists instead, every tensor is the same."""
    from grpo_sdk.rollouts import rollout

    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "grpo.max_rollout_turns=1")
    parts, seen = trainer.components, {}
    batch_of = rollout.batch_of

    def both(episodes, names, pad, groups):
        assert all(e.sampled is not None for e in episodes)
        seen["tensors"] = batch_of(episodes, names, pad, groups)
        for e in episodes:
            e.sampled = None
        seen["lists"] = batch_of(episodes, names, pad, groups)
        return seen["tensors"]

    rollout.batch_of = both
    try:
        trainer.collect_rollouts()
    finally:
        rollout.batch_of = batch_of
    tensors, lists = seen["tensors"], seen["lists"]
    for name in ("response_ids", "response_lengths", "generation_logprobs", "truncated", "reward_valid"):
        assert torch.equal(getattr(tensors, name), getattr(lists, name)), name
    assert tensors.generation_logprobs.dtype == torch.float32 and tensors.generated_mask is None
    assert tensors.weight_version == lists.weight_version and tensors.token_weight_versions is None
    assert bool((tensors.response_lengths < tensors.response_ids.shape[1]).any())  # padding was compared too
    trainer.shutdown()
