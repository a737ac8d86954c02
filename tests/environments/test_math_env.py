"""The math environment with the real math-verify: answer extraction, equivalent forms, GSM8K's
format, bad metadata, timeouts, and scoring off the main thread or in worker processes."""

from __future__ import annotations

import threading
import time

import pytest

from grpo_sdk.core.records import Message
from grpo_sdk.environments.math_env import MathEnvironment, extract_answer, last_boxed
from grpo_sdk.environments.specs import MathEnvConfig

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def log(response: str) -> list[Message]:
    return [Message(role="user", content="a question"), Message(role="assistant", content=response)]


def rewards(env, pairs):
    ret = env.step([log(r) for r, _ in pairs], [{"answer": g} for _, g in pairs])
    return ret.rewards["correct"], ret.metrics


@pytest.fixture(scope="module")
def env():
    return MathEnvironment(MathEnvConfig(timeout_seconds=1), context=None)


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{\sqrt{3}}{2}} is it", (r"\frac{\sqrt{3}}{2}", "boxed")),
    (r"\boxed{1} first, then \boxed{\{1, 2\}}", (r"\{1, 2\}", "boxed")),
    (r"\boxed{3} and then \boxed{4", ("3", "boxed")),  # a truncated last box is skipped
    (r"$\fbox{x^{2}}$", ("x^{2}", "boxed")),
    ("Step one gives 5.\n#### 1,000\nThanks", ("1,000", "hashes")),
    ("So the final answer is: $\\frac{3}{4}$. Check: 3/4 = 0.75.", ("$\\frac{3}{4}$", "answer_is")),
    ("Answer: 42 apples", ("42 apples", "answer_is")),
    ("First 12, then 7.5 left", ("7.5", "last_number")),
    ("I do not know", (None, "none")),
])
def test_answer_extraction(text, expected):
    assert extract_answer(text) == expected


def test_plain_fallback_can_be_turned_off():
    assert extract_answer("The answer is 42", plain_fallback=False) == (None, "none")
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"


def test_equivalent_forms_score_one(env):
    got, metrics = rewards(env, [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        (r"Hence \boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
        (r"\boxed{x = 5}", "5"),
    ])
    assert got == [1.0] * 5
    assert metrics == {"extracted_fraction": 1.0, "boxed_fraction": 1.0}


def test_wrong_and_missing_answers_score_zero(env):
    got, metrics = rewards(env, [(r"\boxed{3}", "4"), (r"\boxed{0.333}", "1/3"), ("no idea", "7"),
                                 (r"\boxed{2}", "2")])
    assert got == [0.0, 0.0, 0.0, 1.0]
    assert metrics == {"extracted_fraction": 0.75, "boxed_fraction": 0.75}


def test_gsm8k_format_in_responses_and_gold_answers(env):
    got, metrics = rewards(env, [
        ("48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72", "72"),
        ("She has 1,000 apples.\n#### 1,000", "1000"),
        ("72", GSM8K_SOLUTION),                      # gold: a whole solution ending in '#### 72'
        ("The answer is 72. (Check: 24 + 48.)", GSM8K_SOLUTION),
        ("The answer is 71.", 72),                    # gold as a JSON number
    ])
    assert got == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert metrics == {"extracted_fraction": 1.0, "boxed_fraction": 0.0}


def test_missing_or_empty_gold_answer_is_a_clear_error(env):
    with pytest.raises(ValueError, match=r"row metadata has no 'answer' key \(env.math.answer_key\); keys: "
                                         r"\['solution'\]"):
        env.step([log(r"\boxed{1}")], [{"solution": "1"}])
    with pytest.raises(ValueError, match="gold answer 'answer' must be a non-empty string or a number, got ''"):
        env.step([log(r"\boxed{1}")], [{"answer": ""}])


def test_the_loop_names_the_sample_with_bad_metadata(env):
    from grpo_sdk.core.errors import EnvironmentStepError
    from grpo_sdk.rollouts.environment_step import step_environment

    logs, meta = [log(r"\boxed{1}"), log(r"\boxed{2}")], [{"answer": "1"}, {"final": "2"}]
    with pytest.raises(EnvironmentStepError, match=r"'math' failed on sample 1 \(data.jsonl line 2, .*no 'answer' key"):
        step_environment(env, "math", logs, meta, ["data.jsonl line 1", "data.jsonl line 2"], "raise")


def test_a_pathological_answer_times_out_and_scores_zero(env):
    start = time.perf_counter()
    got, _ = rewards(env, [(r"\boxed{(10^{10^{5}})!}", "3"), (r"\boxed{3}", "3")])
    assert got == [0.0, 1.0]
    assert time.perf_counter() - start < 10  # timeout_seconds=1 per comparison, not forever


def test_scoring_off_the_main_thread_and_in_workers_matches(env):
    pairs = [(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{3}", "4"), ("#### 72", GSM8K_SOLUTION), ("nothing", "1")]
    expected = rewards(env, pairs)
    threaded_env = MathEnvironment(MathEnvConfig(timeout_seconds=1), context=None)
    result = []
    worker = threading.Thread(target=lambda: result.append(rewards(threaded_env, pairs)))
    worker.start()
    worker.join(timeout=120)
    threaded_env.shutdown()
    assert result == [expected]
    pooled = MathEnvironment(MathEnvConfig(timeout_seconds=1, num_workers=2), context=None)
    try:
        assert rewards(pooled, pairs) == expected
    finally:
        pooled.shutdown()


def test_math_is_a_registered_environment():
    from grpo_sdk.plugins.registry import Registry

    info = Registry.discover().info("environment", "math")
    assert info is not None and info.ok, info
    assert info.spec.requires == ("math-verify>=0.7",) and info.spec.extra == "math"


def test_without_workers_the_runtime_steps_it_on_the_main_thread_in_process():
    """num_workers=0 asks for the main thread (RunsOnMainThread): no worker process is started, and
    math-verify's own signal.alarm timeouts still bound a pathological answer under the deadline."""
    from grpo_sdk.runtime.deadlines import EnvironmentDeadline

    inner = MathEnvironment(MathEnvConfig(timeout_seconds=1), context=None)
    env = EnvironmentDeadline(inner, "math", timeout=60)
    seen = []
    real = inner.step
    inner.step = lambda logs, meta: (seen.append(threading.current_thread() is threading.main_thread()),
                                     real(logs, meta))[1]
    ret = env.step([log(r"\boxed{(10^{10^{5}})!}"), log(r"\boxed{3}")], [{"answer": "3"}] * 2)
    assert ret.rewards["correct"] == [0.0, 1.0] and seen == [True] and inner._pool is None
    pooled = MathEnvironment(MathEnvConfig(timeout_seconds=1, num_workers=2), context=None)
    assert not pooled.runs_on_main_thread()
