"""Reward functions as TRL users write them: called on the trainer's main thread, so math-verify's
signal-based timeouts work, with ``cluster.call_timeout_s`` still enforced (``call_on_main_thread``
in runtime/deadlines.py interrupts the main thread; what cannot be interrupted ends the process).

The math-verify functions below are math-verify itself with its default timeouts, nothing faked;
before reward functions ran on the main thread they failed with "Math-Verify 'parse' function
doesn't support threaded environment" (issue 33).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

import grpo_sdk
from helpers import run_grpoctl, small_trainer
from grpo_sdk.core.errors import EnvironmentStepError
from grpo_sdk.runtime.deadlines import INTERRUPT_SIGNAL, CallTimeout, call_on_main_thread

pytest.importorskip("math_verify")

ON_MAIN_THREAD: list[bool] = []  # one entry per call of math_correct


def math_correct(completions, answer, **kwargs):
    """TRL's documented accuracy reward, as users copy it: math-verify's parse and verify, defaults."""
    from math_verify import parse, verify

    ON_MAIN_THREAD.append(threading.current_thread() is threading.main_thread())
    assert verify(parse("$\\frac{1}{2}$"), parse("0.5"))  # math-verify really ran, timeouts and all
    return [float(verify(parse(a), parse(c))) for c, a in zip(completions, answer)]


def math_rows(path, count=32):
    """The tiny model's reversal task, its gold answer in the column TRL's math rewards read."""
    import random

    rng = random.Random(0)
    digits = ["".join(rng.choice("123456789") for _ in range(5)) for _ in range(count)]
    path.write_text("".join(json.dumps({"prompt": f"{d}>", "answer": d[::-1], "n": i}) + "\n"
                            for i, d in enumerate(digits)))
    return path


SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
         "grpo.val_period=0", "grpo.val_at_end=false"]


# --- call_on_main_thread -------------------------------------------------------------------------------


def _busy():
    while True:
        pass


def _swallows_exceptions():  # math-verify's parse catches Exception: the interrupt must get through
    while True:
        try:
            time.sleep(30)
        except Exception:  # noqa: BLE001
            pass


@pytest.mark.parametrize("hang", [_busy, _swallows_exceptions, threading.Event().wait, time.sleep],
                         ids=["python-loop", "except-Exception", "lock-wait", "builtin-sleep"])
def test_a_call_stuck_on_the_main_thread_is_interrupted_at_its_deadline(hang):
    start = time.monotonic()
    with pytest.raises(CallTimeout, match=r"x did not return within 0.3 s \(cluster.call_timeout_s\)"):
        call_on_main_thread(hang, *([30] if hang is time.sleep else []), timeout=0.3, what="x")
    assert time.monotonic() - start < 2


def test_a_call_that_returns_or_raises_is_unchanged_and_no_interrupt_arrives_late():
    assert call_on_main_thread(lambda a: a + 1, 1, timeout=0.3, what="x") == 2
    with pytest.raises(ZeroDivisionError):
        call_on_main_thread(lambda: 1 / 0, timeout=0.3, what="x")
    time.sleep(0.6)  # past both deadlines: a watchdog that outlived its call would interrupt this sleep


def test_an_alarm_inside_the_call_nests_with_the_deadline():
    """The call's own SIGALRM (math-verify's timeout) fires, is handled, and leaves our deadline be."""
    def alarmed():
        def on_alarm(signum, frame):
            raise TimeoutError("own alarm")

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        try:
            time.sleep(5)
        except TimeoutError:
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        time.sleep(5)  # then hangs: the deadline still stops it

    assert INTERRUPT_SIGNAL != signal.SIGALRM
    start = time.monotonic()
    with pytest.raises(CallTimeout):
        call_on_main_thread(alarmed, timeout=0.5, what="x")
    assert 0.4 < time.monotonic() - start < 2


def test_off_the_main_thread_it_refuses():
    box = {}
    thread = threading.Thread(target=lambda: box.update(error=_raises(lambda: call_on_main_thread(
        lambda: 1, timeout=1, what="x"))))
    thread.start()
    thread.join(10)
    assert isinstance(box["error"], RuntimeError)


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


# --- math-verify through the trainer -------------------------------------------------------------------


def test_math_verify_scores_from_a_config_named_function(registry, tmp_path, tiny_model_dir):
    ON_MAIN_THREAD.clear()
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "env.name=reward_functions", *SMALL,
                            f"data.train_path={math_rows(tmp_path / 'd.jsonl')}",
                            "env.reward_functions.functions=[test_reward_functions_main_thread:math_correct]")
    metrics, _ = trainer.train_step()
    trainer.shutdown()
    assert ON_MAIN_THREAD == [True]
    assert 0.0 <= metrics["reward/math_correct"] <= 1.0


def test_math_verify_scores_through_the_python_api_from_a_closure_and_a_module_function(tmp_path):
    ON_MAIN_THREAD.clear()
    threads = []

    def closure_correct(completions, answer):  # a closure: a process-local callable: reference
        from math_verify import parse, verify

        threads.append(threading.current_thread().name)
        return [float(verify(parse(a), parse(c))) for c, a in zip(completions, answer)]

    summary = grpo_sdk.train(overrides=[f"data.train_path={math_rows(tmp_path / 'd.jsonl')}", *SMALL],
                             run_dir=tmp_path / "run",
                             reward_funcs=[math_correct, closure_correct, lambda completions: [0.0] * len(completions)])
    assert summary.status == "completed" and summary.steps == 2
    assert ON_MAIN_THREAD == [True, True] and threads == ["MainThread", "MainThread"]
    assert {"reward/math_correct", "reward/closure_correct", "reward/lambda"} <= set(summary.metrics)


def picky(completions, n):
    if any(i % 2 for i in n):
        raise ValueError("cannot score an odd row")
    return [0.5] * len(completions)


def test_a_raising_function_is_still_masked_with_on_reward_error_mask(registry, tmp_path, tiny_model_dir):
    """The batch raises, each sample is retried alone on the main thread, the failing ones leave the loss."""
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "env.name=reward_functions", *SMALL,
                            f"data.train_path={math_rows(tmp_path / 'd.jsonl')}", "env.on_reward_error=mask",
                            "data.shuffle=false", "env.reward_functions.functions=[test_reward_functions_main_thread:picky]")
    metrics, _ = trainer.train_step()  # rows 0..3, 4 samples each: rows 1 and 3 fail
    trainer.shutdown()
    assert metrics["reward/num_failed"] == 8 and metrics["reward/mean"] == 0.5


def test_a_function_stuck_through_the_python_api_stops_the_run_at_the_deadline(tmp_path):
    def hangs(completions):
        threading.Event().wait()  # a lock wait on the main thread: only a signal wakes it

    start = time.monotonic()
    with pytest.raises(EnvironmentStepError, match=r"did not return a reward for sample 0 .* within 1 s "
                                                   r"\(cluster.call_timeout_s\)"):
        grpo_sdk.train(overrides=[f"data.train_path={math_rows(tmp_path / 'd.jsonl')}", *SMALL,
                                  "cluster.call_timeout_s=1"], run_dir=tmp_path / "run", reward_funcs=[hangs])
    assert time.monotonic() - start < 30  # start-up, a step's generation, then two 1 s deadlines


DEAF = """
import re, time

def deaf(completions):  # catches every interrupt: nothing in Python can stop it
    while True:
        try:
            time.sleep(30)
        except BaseException:
            pass

def backtracks(completions):  # native code holding the GIL: no Python runs until it returns
    re.match(r"(a+)+$", "a" * 64 + "b")
"""


@pytest.mark.slow
@pytest.mark.parametrize("function, expected", [
    ("deaf", "cannot be interrupted"),
    ("backtracks", "Timeout ("),  # faulthandler's C watchdog: every thread's stack, then exit 1
])
def test_a_function_that_cannot_be_interrupted_ends_the_process_soon_after_the_deadline(tmp_path, function, expected):
    (tmp_path / "uninterruptible.py").write_text(DEAF)
    start = time.monotonic()
    result = run_grpoctl("run", "--run-dir", "run", "env.name=reward_functions", *SMALL, "cluster.call_timeout_s=1",
                         f"data.train_path={math_rows(tmp_path / 'd.jsonl')}",
                         f"env.reward_functions.functions=[uninterruptible:{function}]", cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert expected in result.stderr and f"in {function}" in result.stderr  # the stack names the function
    assert time.monotonic() - start < 90
