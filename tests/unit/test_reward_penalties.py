"""NeMo-RL's reward penalties (``reward_penalties.*``) and per-group length penalty (``grpo.length_penalty``).

Penalty cases are NeMo-RL's (``tests/unit/experience/test_reward_penalties.py``), restated over generated
messages instead of NeMo-Gym's Responses-API items; length-penalty numbers are pinned to NeMo-RL's
``tests/unit/utils/test_length_penalty.py`` where it has them and computed by hand (in the comments)
where it has none. Then the config errors (`grpoctl config validate`, exit 2) and one short run.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import attrs
import pytest
import torch

from grpo_sdk.algorithms.length_penalty import apply_length_penalty, band_multiplier
from grpo_sdk.algorithms.reward_penalties import (
    ThinkTags,
    generated_turns,
    malformed_think,
    malformed_think_ids,
    resolve_think_tags,
    split_think,
    thinking_mode,
)
from grpo_sdk.algorithms.rewards import RolloutRewardChanges, mean_metrics
from grpo_sdk.config import schema as C
from grpo_sdk.core.records import Message

OPEN, CLOSE = 12, 13  # the think tags' token ids in the token-id cases, as upstream's tests


def user(ids=(100,), content="q"):
    return Message(role="user", content=content, token_ids=tuple(ids))


def gen(content="", ids=(300,), flags=()):
    return Message(role="assistant", content=content, token_ids=tuple(ids),
                   generation_logprobs=tuple(0.0 for _ in ids), flags=tuple(flags))


def changes(penalties=None, length=None, tokenizer=None):
    cfg = SimpleNamespace(reward_penalties=penalties or C.RewardPenaltyConfig(),
                          grpo=SimpleNamespace(length_penalty=length or C.LengthPenaltyConfig()))
    return RolloutRewardChanges(cfg, tokenizer)


def penalize(logs, rewards=None, prompt_ids=None, **flags):
    """Rewards after the penalties in ``flags`` (and their metrics): one sample per log, reward 1 by default."""
    ids = flags.pop("token_ids", {})
    cfg = C.RewardPenaltyConfig(**flags, token_ids=C.RewardPenaltyTokenIdsConfig(**ids))
    size = len(logs)
    components = {"reward": torch.tensor(rewards if rewards is not None else [1.0] * size)}
    out, total, metrics = changes(cfg)(components, torch.ones(size, dtype=torch.bool), torch.arange(size), logs,
                                       [{}] * size, prompt_ids)
    torch.testing.assert_close(out["reward"], total)  # the components are zeroed with the total
    return total.tolist(), metrics


# --- the think-tag helpers (also grpo.malformed_thinking_advantage's) ---------------------------------


@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>a</think>b", None, ("a", "b")),
    ("a</think>b", True, ("a", "b")),  # the prompt opened the block
    ("  <think>a</think> b", None, ("a", " b")),
    ("42", None, ("", "42")),  # no tags: all answer
    ("42", True, ("42", "")),  # the prompt opened a block the model never closed: all reasoning
    ("<think>still thinking", None, ("still thinking", "")),  # unclosed: no answer
    ("<think>a<think>b</think>c</think>d", None, ("a<think>b", "c</think>d")),  # nested: split at the first close
])
def test_split_think(text, thinking, expected):
    assert split_think(text, "<think>", "</think>", thinking) == expected


@pytest.mark.parametrize("text, malformed", [
    ("", False), ("42", False), ("thinking </think> answer", False),
    ("some <think> text </think> answer", True),  # the open tag generated (it belongs to the prompt)
    ("</think> text </think>", True),  # two closes
    ("<think>a<think>b</think>c</think>", True),  # nested
    ("<think>never closed", True),
])
def test_malformed_think_text(text, malformed):
    assert malformed_think(text) is malformed


@pytest.mark.parametrize("context, mode", [
    ([100, 12, 200], True), ([100, 12, 13, 200], False), ([100, 200], False), ([100, 12, 12, 200], None),
    ([100, 13, 13, 12], None), ([100, 12, 13, 12, 13, 12, 13, 12, 13, 12], True),  # history: only the balance counts
])
def test_thinking_mode_from_context(context, mode):
    assert thinking_mode(context, OPEN, CLOSE) is mode


@pytest.mark.parametrize("generated, thinking, malformed", [
    ([300, 13, 400], True, False), ([300, 400], False, False), ([300, 400], True, True),
    ([300, 13, 400, 13], True, True), ([300, 13, 400], False, True), ([12, 300, 13], True, True),
    ([300, 400], None, True),
])
def test_malformed_think_ids(generated, thinking, malformed):
    assert malformed_think_ids(generated, OPEN, CLOSE, thinking) is malformed


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=False):
        assert not add_special_tokens
        if isinstance(text, list):
            return {"input_ids": [self(t)["input_ids"] for t in text]}
        return {"input_ids": self.vocab.get(text, list(range(len(text))))}


def test_think_tag_ids_are_read_from_the_tokenizer_when_each_tag_is_one_token():
    cfg = C.RewardPenaltyConfig()
    assert resolve_think_tags(cfg, FakeTokenizer({"<think>": [12], "</think>": [13]})) == \
        ThinkTags("<think>", "</think>", 12, 13)
    assert resolve_think_tags(cfg, FakeTokenizer({"<think>": [12, 98], "</think>": [13]})).open_id is None
    explicit = C.RewardPenaltyConfig(token_ids=C.RewardPenaltyTokenIdsConfig(think_open=50, think_close=51))
    assert resolve_think_tags(explicit, FakeTokenizer({"<think>": [12], "</think>": [13]})) == \
        ThinkTags("<think>", "</think>", 50, 51)


def test_a_conversational_prompt_reads_its_thinking_mode_from_the_prompt_ids():
    # Its messages carry no token ids (the chat template rendered them together): the row's prompt ids do.
    tags = ThinkTags("<think>", "</think>", OPEN, CLOSE)
    log = [Message(role="system", content="s"), Message(role="user", content="q"), gen("a</think>b", [300, 13])]
    assert generated_turns(log, tags, prompt_ids=[1, 2, 12])[0].thinking is True
    assert generated_turns(log, tags, prompt_ids=None)[0].thinking is False


# --- the four penalties ----------------------------------------------------------------------------------


@pytest.mark.parametrize("log, zeroed", [
    ([user(), gen("The answer is 42</think>The answer is 42")], True),
    ([user(), gen("<think>Let me think about this</think>The answer is 42")], False),
    ([user(), gen("  hello world  </think>hello world")], True),  # stripped before comparing
    ([user(), gen("</think>")], False),  # empty reasoning
    ([user(), gen("The answer is 42")], False),  # no think tags: no reasoning to repeat
    ([user(), gen("dup</think>dup"), user(), gen("different thinking</think>final answer")], True),  # any turn
])
def test_duplicated_reasoning(log, zeroed):
    rewards, metrics = penalize([log], penalize_duplicated_reasoning=True)
    assert rewards == [0.0 if zeroed else 1.0]
    assert metrics["reasoning_equal_to_final_answer_rate"] == float(zeroed)


@pytest.mark.parametrize("log, zeroed", [
    ([user(), gen("thinking</think>")], True),
    ([user(), gen("thinking</think>The answer is 42")], False),
    ([user(), gen("thinking</think>   ")], True),  # whitespace only
    ([user(), gen("42")], False),  # no think block: the whole text is the answer
    ([user(), gen("")], True),
    ([user()], True),  # no generated message at all
    ([user(), gen("<think>out of tokens mid-thought")], True),  # unclosed: ours, no answer was written
    ([user(), gen("t</think>answer"), user(), gen("t</think>")], True),  # the last turn is the final answer
    ([user(), gen("t</think>"), user(), gen('<tool_call>{"name": "f"}</tool_call>')], False),  # a tool call
])
def test_empty_final_answer(log, zeroed):
    rewards, metrics = penalize([log], penalize_empty_final_answer=True)
    assert rewards == [0.0 if zeroed else 1.0]
    assert metrics["empty_final_answer_rate"] == float(zeroed)


@pytest.mark.parametrize("log, unwanted, zeroed", [
    ([user([100, 200]), gen(ids=[300, 2, 400])], [2], True),
    ([user([100, 200]), gen(ids=[300, 400, 500])], [2], False),
    ([user([100, 200]), gen(ids=[300, 400, 2])], [2], True),  # the last token too (a stop token, if listed)
    ([user([100, 2, 200]), gen(ids=[300, 400])], [2], False),  # the prompt's tokens are not the model's
    ([user([100]), gen(ids=[300, 99, 400])], [98, 99], True),
    ([user([100]), gen(ids=[300, 400]), user([500]), gen(ids=[600, 2, 700])], [2], True),  # any turn
    ([user([100]), gen(ids=[])], [2], False),
])
def test_unwanted_tokens(log, unwanted, zeroed):
    rewards, metrics = penalize([log], penalize_unwanted_tokens=True, token_ids={"unwanted": unwanted})
    assert rewards == [0.0 if zeroed else 1.0]
    assert metrics["unwanted_token_rate"] == float(zeroed)


IDS = {"think_open": OPEN, "think_close": CLOSE}


@pytest.mark.parametrize("log, token_ids, zeroed", [
    ([user([100, 12, 200]), gen("t</think>a", [300, 13, 400])], IDS, False),  # thinking on
    ([user([100, 12, 13, 200]), gen("a", [300, 400])], IDS, False),  # thinking off (an empty block in the prompt)
    ([user([100, 200]), gen("t</think>a", [300, 13, 400])], IDS, True),  # a close nobody opened
    ([user([100, 12, 200]), gen("t", [300, 400])], IDS, True),  # never closed
    ([user([100, 12, 200]), gen("t</think>a</think>", [300, 13, 400, 13])], IDS, True),
    ([user([100, 12, 12, 200]), gen("t</think>a", [300, 13, 400])], IDS, True),  # a malformed prompt
    ([user([100, 12]), gen("t</think>a", [300, 13, 400]), user([500, 12]), gen("u</think>b", [600, 13, 700])],
     IDS, False),
    ([user([100, 12]), gen("t</think>a", [300, 13, 400]), user([500, 12]), gen("u", [600, 13, 13, 700])],
     IDS, True),
    ([user([100, 12, 13, 12, 13, 12, 13, 12, 13, 12]), gen("t</think>a", [300, 13, 400])], IDS, False),
    ([user([100, 12, 13]), gen("t</think>a", [300, 13, 400])], IDS, True),  # thinking off, yet a close
    ([user([100, 13, 13, 12]), gen("a", [300, 400])], IDS, True),
    ([user(), gen("a", flags=["malformed_thinking"])], {}, True),  # the environment's flag
    ([user([100, 12]), gen("some <think> text </think> answer", [300, 13, 400])], IDS, True),  # spelled out
    ([user([100, 12]), gen("</think> text </think>", [300, 13, 400])], IDS, True),
    ([user([100, 12]), gen("thinking </think> answer", [300, 13, 400])], IDS, False),
    ([user(), gen("no tags at all")], {}, False),  # tag ids unknown: the string check alone
    ([user(), gen("thinking </think> answer")], {}, False),
])
def test_malformed_think_tag(log, token_ids, zeroed):
    rewards, metrics = penalize([log], penalize_malformed_think_tag=True, token_ids=token_ids)
    assert rewards == [0.0 if zeroed else 1.0]
    assert metrics["malformed_think_tag_rate"] == float(zeroed)


def test_penalties_stack_count_separately_and_only_the_enabled_ones_report():
    logs = [[user([100]), gen("same</think>same", [300, 2, 400])],  # both penalties
            [user([100]), gen("a</think>b", [300, 400])],
            [user([100]), gen("x</think>y", [300, 2])],  # unwanted, but its reward is already 0
            [user([100]), gen("z", [300])]]
    rewards, metrics = penalize(logs, rewards=[1.0, 0.5, 0.0, 1.0], penalize_duplicated_reasoning=True,
                                penalize_unwanted_tokens=True, token_ids={"unwanted": [2]})
    assert rewards == [0.0, 0.5, 0.0, 1.0]
    assert metrics == {"reasoning_equal_to_final_answer_rate": 0.25, "unwanted_token_rate": 0.5,
                       "reward_penalties/zeroed_fraction": 0.25}


def test_nothing_enabled_changes_nothing_and_reports_nothing():
    components = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.5, 0.5])}
    out, total, metrics = changes()(components, torch.ones(2, dtype=torch.bool), torch.zeros(2), [[gen("x")]] * 2,
                                    [{}, {}])
    assert out is components and metrics == {}
    torch.testing.assert_close(total, torch.tensor([1.5, 0.5]))


# --- the length penalty ----------------------------------------------------------------------------------


def lengths(*pairs):
    """Per-row (reasoning, answer) lengths -> the three channels apply_length_penalty reads."""
    return {"reasoning": [float(r) for r, _ in pairs], "answer": [float(a) for _, a in pairs],
            "total": [float(r + a) for r, a in pairs]}


def length_penalty(rewards, pairs, metadata=None, groups=None, profile_band=None, **params):
    cfg = C.LengthPenaltyConfig(default=C.LengthPenaltyParams(length_type="chars", **params),
                                profile_band=profile_band or C.ProfileBandConfig())
    return apply_length_penalty(rewards, groups or [list(range(len(rewards)))], lengths(*pairs),
                                metadata or [{}] * len(rewards), cfg)


def approx(values):
    return pytest.approx(values, abs=1e-12)


@pytest.mark.parametrize("rewards, pairs, params, expected", [
    # NeMo-RL's numbers (TestGroupRelativeLengthScaling): totals 10/30 -> weights 1/0 -> centred +-0.5, x 0.1
    ([1.0, 1.0], [(5, 5), (25, 5)], {"group_total_length_penalty_coeff": 0.1}, [1.05, 0.95]),
    ([1.0, 1.0, 1.0], [(5, 5), (10, 10), (15, 15)], {"group_total_length_penalty_coeff": 0.1}, [1.05, 1.0, 0.95]),
    ([1.0, 1.0], [(5, 5), (5, 5)], {"group_total_length_penalty_coeff": 0.1}, [1.0, 1.0]),
    ([1.0, 0.0, 1.0], [(5, 5), (1000, 1000), (25, 5)], {"group_total_length_penalty_coeff": 0.1}, [1.05, 0.0, 0.95]),
    ([1.0, 1.0], [(5, 15), (15, 5)], {"group_reasoning_length_penalty_coeff": 0.1}, [1.05, 0.95]),
    ([1.0, 1.0], [(5, 5), (25, 5)], {"group_total_length_penalty_coeff": 0.2}, [1.1, 0.9]),  # enabled by default
    # TestPassRateLengthPenalty: -w x pass rate x L / L_max over the successes
    ([1.0, 1.0], [(5, 5), (10, 10)], {"pass_rate_length_penalty_weight": 0.2}, [0.9, 0.8]),
    ([1.0, 0.0], [(10, 10), (5, 5)], {"pass_rate_length_penalty_weight": 0.2}, [0.9, 0.0]),
    ([0.0, 0.0], [(5, 5), (10, 10)], {"pass_rate_length_penalty_weight": 0.2}, [0.0, 0.0]),
    ([1.0, 0.0], [(10, 10), (20, 20)], {"pass_rate_length_penalty_weight": 0.2}, [0.9, 0.0]),  # a long failure: no say
    ([1.0, 1.0], [(5, 5), (10, 10)], {"longest_total_penalty": 0.2}, [1.0, 0.8]),  # TestReviewFixes
    ([-1.0, 1.0], [(5, 5), (10, 10)], {"group_total_length_penalty_coeff": 0.1}, [-1.0, 1.0]),  # not 0/1: skipped
    ([0.5, 1.0], [(5, 5), (10, 10)], {"group_total_length_penalty_coeff": 0.1}, [0.5, 1.0]),
    # By hand: the shortest success (total 6) gets the bonus; ties go to the first row, as upstream's min().
    ([1.0, 1.0, 1.0], [(5, 5), (3, 3), (4, 4)], {"total_bonus": 0.1}, [1.0, 1.1, 1.0]),
    ([1.0, 1.0, 0.0], [(3, 3), (3, 3), (1, 1)], {"total_bonus": 0.1}, [1.1, 1.0, 0.0]),
    # By hand: reasoning [10, 10, 11, 12, 40], median 11, MAD 1, z(40) = 0.6745 x 29 = 19.6 > 3.5, z(12) = 0.67
    ([1.0] * 5, [(10, 1), (10, 1), (11, 1), (12, 1), (40, 1)], {"reasoning_zmad_threshold": 3.5,
                                                                "reasoning_zmad_penalty": 0.2}, [1, 1, 1, 1, 0.8]),
    # One success only: nothing to compare it with.
    ([1.0, 0.0], [(5, 5), (25, 5)], {"group_total_length_penalty_coeff": 0.1, "total_bonus": 0.3}, [1.0, 0.0]),
])
def test_length_penalty_math(rewards, pairs, params, expected):
    assert length_penalty(rewards, pairs, **params)[0] == approx(expected)


def profiled(p_rewards, p_lengths):
    return {"profiled_rewards": p_rewards, "profiled_output_lengths": p_lengths}


@pytest.mark.parametrize("meta, pairs, min_samples, penalty, expected", [
    # NeMo-RL's TestProfiledLengthPenalty: passing lengths 10 and 14, threshold 12 + 2.83 = 14.83; total 20 >= it
    (profiled([1, 1, 0], [10, 14, 100]), [(5, 5), (10, 10)], 2, 0.3, [1.0, 0.7]),
    (profiled([1, 0, 0], [10, 100, 120]), [(10, 10), (50, 50)], 2, 0.3, [1.0, 1.0]),  # one pass < min_samples
    (profiled([0, 0, 0], [10, 12, 14]), [(10, 10), (50, 50)], 2, 0.3, [1.0, 1.0]),
    (profiled([1, 0], [10, 100]), [(4, 4), (10, 10)], 1, 0.3, [1.0, 0.7]),  # threshold 10 + 0: 8 < 10 <= 20
    (profiled([1, 1], [10, 10]), [(4, 4), (10, 10)], 2, 1.5, [1.0, 0.0]),  # clamped at 0, never negative
])
def test_profiled_length_penalty(meta, pairs, min_samples, penalty, expected):
    rewards, _ = length_penalty([1.0, 1.0], pairs, metadata=[meta, meta], profiled_length_penalty=penalty,
                                profiled_length_min_samples=min_samples, profiled_length_n_std=1.0)
    assert rewards == approx(expected)


def test_an_all_wrong_group_stays_variance_free():
    meta = profiled([1, 1], [10, 10])
    assert length_penalty([0.0, 0.0], [(4, 4), (10, 10)], metadata=[meta, meta], profiled_length_penalty=0.3)[0] == \
        [0.0, 0.0]


@pytest.mark.parametrize("length, expected", [(5, 1.0), (10, 1.0), (15, 0.75), (20, 0.5), (25, 0.5), (10_000, 0.5)])
def test_band_multiplier(length, expected):
    assert band_multiplier(length, {"a": 10, "b": 20, "f": 0.5}) == pytest.approx(expected)


def test_band_multiplier_ignores_missing_or_malformed_bands():
    for band in (None, {}, {"a": 10, "b": 20}, {"a": 20, "b": 10, "f": 0.5}):
        assert band_multiplier(100, band) == 1.0


BAND = {"total": {"a": 10, "b": 20, "f": 0.5}}
GLOBAL = C.ProfileBandConfig(enabled=True, defaults=C.ProfileBandDefaults(total=C.ProfileBandChannel(a=10, b=20, f=0.5)))


@pytest.mark.parametrize("rewards, pairs, rows, profile_band, params, expected", [
    ([1.0, 1.0], [(5, 5), (10, 10)], BAND, None, {"profile_band_total": True}, [1.0, 0.5]),  # NeMo-RL's numbers
    ([0.0, 1.0], [(10, 10), (10, 10)], BAND, None, {"profile_band_total": True}, [0.0, 0.5]),
    ([1.0, 1.0], [(5, 100), (15, 100)], {"reasoning": {"a": 10, "b": 20, "f": 0.5}}, None,
     {"profile_band_reasoning": True}, [1.0, 0.75]),
    ([1.0, 1.0], [(5, 5), (25, 5)], None, None, {"profile_band_total": True}, [1.0, 1.0]),  # no band anywhere
    ([1.0, 1.0], [(10, 10), (5, 5)], BAND, None, {}, [1.0, 1.0]),  # the switch is off
    ([1.0, 1.0], [(5, 5), (25, 5)], None, GLOBAL, {}, [1.0, 0.5]),  # a global band switches its channel on
    ([1.0, 1.0], [(5, 5), (25, 5)], {"total": {"a": 100, "b": 200, "f": 0.5}}, GLOBAL, {}, [1.0, 1.0]),  # row wins
    ([1.0, 1.0], [(25, 5), (5, 5)], None, attrs.evolve(GLOBAL, enabled=False), {}, [1.0, 1.0]),
    ([1.0, 1.0], [(25, 5), (5, 5)], None, GLOBAL, {"profile_band_total": False}, [1.0, 1.0]),  # explicit false wins
])
def test_profile_bands(rewards, pairs, rows, profile_band, params, expected):
    meta = [{"profile_band": rows} if rows else {} for _ in rewards]
    assert length_penalty(rewards, pairs, metadata=meta, profile_band=profile_band, **params)[0] == approx(expected)


def test_the_profile_gate_applies_the_dense_term_to_long_groups_only():
    # By hand: band total a = 15. Group 0 totals 10/30, mean 20 > 15: open, +-0.05. Group 1 totals 4/10, mean 7: closed.
    meta = [{"profile_band": {"total": {"a": 15, "b": 100, "f": 1.0}}}] * 4
    rewards, _ = length_penalty([1.0] * 4, [(5, 5), (25, 5), (2, 2), (5, 5)], metadata=meta, groups=[[0, 1], [2, 3]],
                                group_total_length_penalty_coeff=0.1, group_length_penalty_profile_gate=True,
                                profile_band_total=False)
    assert rewards == approx([1.05, 0.95, 1.0, 1.0])
    closed, _ = length_penalty([1.0, 1.0], [(5, 5), (25, 5)], group_total_length_penalty_coeff=0.1,
                               group_length_penalty_profile_gate=True)  # no band: the gate stays shut
    assert closed == [1.0, 1.0]


def test_length_penalty_metrics_are_per_row_means():
    # NeMo-RL's test_returns_rollout_metrics: totals 8/20/20/20, threshold 10: rows 1-2 lose 1.5, clamp to 0.
    meta = profiled([1, 1], [10, 10])
    rewards, metrics = length_penalty([1.0, 1.0, 1.0, 0.0], [(4, 4), (10, 10), (10, 10), (10, 10)], metadata=[meta] * 4,
                                      profiled_length_penalty=1.5)
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert metrics == approx({"length_penalty/env_reward_mean": 0.75, "length_penalty/reward_delta_mean": -0.5,
                              "length_penalty/bonus_mean": 0.0, "length_penalty/penalty_mean": -0.5,
                              "length_penalty/wiped_correct_frac": 0.5, "length_penalty/adjusted_frac": 0.5,
                              "length_penalty/skipped_non_binary_frac": 0.0})


def run_changes(texts, rewards, penalties=None, training=True, components=None, **params):
    """RolloutRewardChanges on one group of single-turn samples whose prompt opened a think block."""
    cfg = C.LengthPenaltyConfig(default=C.LengthPenaltyParams(length_type="chars", **params))
    logs = [[user(), gen(text)] for text in texts]
    size = len(texts)
    components = components or {"reward": torch.tensor(rewards)}
    return changes(penalties, cfg)(components, torch.ones(size, dtype=torch.bool), torch.zeros(size, dtype=torch.long),
                                   logs, [{}] * size, training=training)


def test_the_length_penalty_runs_after_the_penalties_and_keeps_the_env_reward_in_the_components():
    # NeMo-RL's test_runs_after_reward_penalties: row 2 repeats its reasoning, is zeroed first and drops out of
    # the successes; rows 0-1 (totals 10/30) get exactly +-0.05. The components keep the reward the length
    # penalty was handed (NeMo-RL's env_reward).
    texts = ["1234</think>123456", "1" * 20 + "</think>" + "1" * 10, "x" * 50 + "</think>" + "x" * 50]
    out, total, metrics = run_changes(texts, [1.0, 1.0, 1.0], C.RewardPenaltyConfig(penalize_duplicated_reasoning=True),
                                      group_total_length_penalty_coeff=0.1)
    assert total.tolist() == pytest.approx([1.05, 0.95, 0.0])  # float32
    assert out["reward"].tolist() == [1.0, 1.0, 0.0]
    assert metrics["reasoning_equal_to_final_answer_rate"] == pytest.approx(1 / 3)
    assert metrics["length_penalty/env_reward_mean"] == pytest.approx(2 / 3)


def test_validation_gets_the_penalties_but_not_the_length_penalty():
    texts = ["1234</think>123456", "1" * 20 + "</think>" + "1" * 10]
    _, total, metrics = run_changes(texts, [1.0, 1.0], training=False, group_total_length_penalty_coeff=0.1)
    assert total.tolist() == [1.0, 1.0] and metrics == {}


def test_several_reward_components_leave_the_length_penalty_out_with_a_warning():
    texts = ["1234</think>123456", "1" * 20 + "</think>" + "1" * 10]
    components = {"correct": torch.tensor([1.0, 1.0]), "format": torch.tensor([0.0, 0.0])}
    with pytest.warns(UserWarning, match="single reward component"):
        _, total, metrics = run_changes(texts, None, components=components, group_total_length_penalty_coeff=0.1)
    assert total.tolist() == [1.0, 1.0] and metrics["length_penalty/skipped_non_binary_frac"] == 1.0


def test_token_lengths_come_from_the_tokenizer():
    # FakeTokenizer encodes unknown text one token per character, except "long" -> 10 tokens: totals 10 vs 4.
    texts = ["long</think>", "abcd</think>"]
    cfg = C.LengthPenaltyConfig(default=C.LengthPenaltyParams(group_total_length_penalty_coeff=0.1))
    logs = [[user(), gen(text)] for text in texts]
    transform = changes(None, cfg, tokenizer=FakeTokenizer({"long": list(range(10))}))
    _, total, _ = transform({"r": torch.tensor([1.0, 1.0])}, torch.ones(2, dtype=torch.bool), torch.zeros(2), logs,
                            [{}, {}])
    assert total.tolist() == pytest.approx([0.95, 1.05])  # float32


def test_failed_rewards_stay_out_of_the_groups_and_batches_average_by_rows():
    cfg = C.LengthPenaltyConfig(default=C.LengthPenaltyParams(length_type="chars", pass_rate_length_penalty_weight=0.2))
    logs = [[user(), gen("a" * n)] for n in (10, 20, 5)]
    valid = torch.tensor([True, True, False])  # a failed row counts neither as a failure nor in the pass rate
    _, total, _ = changes(None, cfg)({"r": torch.tensor([1.0, 1.0, 0.0])}, valid, torch.zeros(3), logs, [{}] * 3)
    assert total.tolist() == pytest.approx([0.9, 0.8, 0.0])  # float32
    assert mean_metrics([({"m": 1.0}, 1), ({"m": 0.0, "n": 1.0}, 3)]) == {"m": 0.25, "n": 0.75}


# --- config errors -------------------------------------------------------------------------------------


def test_config_errors_name_their_keys_all_at_once(cli):
    code, out, err = cli("config", "validate", "reward_penalties.penalize_unwanted_tokens=true",
                         "reward_penalties.token_ids.think_open=5",
                         "grpo.length_penalty.profile_band.defaults.total.a=10",
                         "grpo.length_penalty.profile_band.defaults.answer.a=10",
                         "grpo.length_penalty.profile_band.defaults.answer.b=5",
                         "grpo.length_penalty.profile_band.defaults.answer.f=0.5",
                         "grpo.length_penalty.profile_band.defaults.reasoning.a=1",
                         "grpo.length_penalty.profile_band.defaults.reasoning.b=5",
                         "grpo.length_penalty.profile_band.defaults.reasoning.f=1.5")
    assert code == 2 and out == ""
    assert "5 config problems" in err
    for path in ("reward_penalties.token_ids.unwanted", "reward_penalties.token_ids.think_close",
                 "grpo.length_penalty.profile_band.defaults.total.b", "grpo.length_penalty.profile_band.defaults.answer.b",
                 "grpo.length_penalty.profile_band.defaults.reasoning.f"):
        assert f"  {path}: " in err, path
    assert "reward_penalties.token_ids.unwanted=[" in err  # the fix, spelled out


@pytest.mark.parametrize("override, path", [
    ('reward_penalties.thinking_tags=["<think>"]', "reward_penalties.thinking_tags"),
    ("reward_penalties.token_ids.unwanted=[-1]", "reward_penalties.token_ids.unwanted"),
    ("grpo.length_penalty.default.total_bonus=-0.1", "grpo.length_penalty.default.total_bonus"),
    ("grpo.length_penalty.default.length_type=token", "grpo.length_penalty.default.length_type"),
    ("grpo.length_penalty.default.top_percentile=0", "grpo.length_penalty.default.top_percentile"),
    ("grpo.length_penalty.agent_overrides={}", "grpo.length_penalty.agent_overrides"),  # NeMo-Gym's, not ours
])
def test_field_errors(cli, override, path):
    code, _, err = cli("config", "validate", override)
    assert code == 2 and f"  {path}: " in err, err


def test_the_length_penalty_with_gdpo_is_an_error(cli):
    code, _, err = cli("config", "validate", "grpo.adv_estimator.name=gdpo", "env.reverse_digits.format_weight=0.1",
                       "grpo.length_penalty.default.group_total_length_penalty_coeff=0.1")
    assert code == 2 and "  grpo.length_penalty.default.enabled: has no effect with grpo.adv_estimator.name=gdpo" in err
    assert cli("config", "validate", "reward_penalties.penalize_unwanted_tokens=true",
               "reward_penalties.token_ids.unwanted=[11]", "grpo.length_penalty.default.total_bonus=0.1")[0] == 0


# --- end to end ------------------------------------------------------------------------------------------


def first_step(run_dir):
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    rows = [json.loads(line) for line in (run_dir / "train_data" / "step_1.jsonl").read_text().splitlines()]
    return metrics, [(next(m["content"] for m in row["content"] if m["role"] == "assistant"), row["rewards"])
                     for row in rows]


def test_the_built_in_recipe_trains_with_a_penalty_on_a_digit(tmp_path):
    import grpo_sdk

    common = ["grpo.max_num_steps=3", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false",
              "logger.dump_train_data=true"]
    seven = 4 + 7  # the character tokenizer: 4 special tokens, then "0".."9"
    grpo_sdk.train(overrides=common, run_dir=tmp_path / "plain")
    summary = grpo_sdk.train(overrides=common + ["reward_penalties.penalize_unwanted_tokens=true",
                                                 f"reward_penalties.token_ids.unwanted=[{seven}]"],
                             run_dir=tmp_path / "penalized")
    assert summary.status == "completed"
    plain_metrics, plain = first_step(tmp_path / "plain")
    metrics, penalized = first_step(tmp_path / "penalized")
    # Step 1 samples the same responses (same seed, same initial weights); a response with a 7 loses its reward.
    assert [text for text, _ in penalized] == [text for text, _ in plain]
    has_seven = [("7" in text) for text, _ in plain]
    assert [r for _, r in penalized] == [0.0 if seven_ else r for seven_, (_, r) in zip(has_seven, plain)]
    assert sum(has_seven) > 0 and metrics["unwanted_token_rate"] == pytest.approx(sum(has_seven) / len(has_seven))
    lost = sum(1 for seven_, (_, r) in zip(has_seven, plain) if seven_ and r != 0)
    assert lost > 0 and metrics["reward_penalties/zeroed_fraction"] == pytest.approx(lost / len(plain))
    assert metrics["reward/mean"] < plain_metrics["reward/mean"]
    assert "unwanted_token_rate" not in plain_metrics
