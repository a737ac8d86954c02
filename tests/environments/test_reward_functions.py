"""Rewards as plain functions: the ``reward_functions`` environment, a reward of None as "no
reward", conversational rows reaching the functions as messages, and the built-in multi-reward
task (reverse_digits' ``format`` component) that every built-in estimator trains on.

The functions the in-process tests name live in this module (``test_reward_functions:exact``);
the tests of the current-directory import write modules to ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
import types

import attrs
import pytest
import torch

from helpers import config_problems, run_grpoctl, small_trainer
from grpo_sdk.config.loading import load_config, to_yaml
from grpo_sdk.core.errors import ConfigError, EnvironmentStepError, PluginError
from grpo_sdk.core.records import EnvironmentReturn, Message
from grpo_sdk.environments import callables
from grpo_sdk.environments import reward_functions as RF
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment, correct_positions
from grpo_sdk.environments.specs import ReverseDigitsConfig, RewardFunctionsConfig
from grpo_sdk.rollouts.environment_step import step_environment
from grpo_sdk.rollouts.rollout import example_of

ENV = ["env.name=reward_functions", "grpo.val_at_end=false", "grpo.val_period=0"]


# --- reward functions the tests name ----------------------------------------------------------------


def exact(prompts, completions, target, **kwargs):
    return [1.0 if c == t else 0.0 for c, t in zip(completions, target)]


def digit_fraction(completions):
    return [sum(ch.isdigit() for ch in c) / 5 for c in completions]


def even_only(completions, n):
    """Scores the rows with an even ``n``; the others get no reward."""
    return [1.0 if i % 2 == 0 else None for i in n]


def never(completions):
    return [None] * len(completions)


def no_sevens(prompts, completions):
    if any(p.startswith("7") for p in prompts):
        raise ValueError("cannot score a 7")
    return [0.5] * len(completions)


def stuck(completions):
    time.sleep(60)


def plain_log(prompt: str, response: str) -> list[Message]:
    """A log as the trainer builds it for a text prompt: the user message carries its token ids."""
    return [Message(role="user", content=prompt, token_ids=(1, 2, 3)),
            Message(role="assistant", content=response, token_ids=(4,), generation_logprobs=(-0.5,))]


def env_of(*functions, weights=None) -> RF.RewardFunctionsEnvironment:
    config = RewardFunctionsConfig(functions=[callables.reference_for(f) for f in functions], weights=weights)
    return RF.RewardFunctionsEnvironment(config, None)


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """``write(name, source)``: a module NAME.py in the current directory (tmp_path); forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    written = []

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)

    yield write
    for name in written:
        sys.modules.pop(name, None)


def write_digits(path, count=64, seed=0):
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(5))
        rows.append({"prompt": f"{digits}>", "target": digits[::-1], "n": i})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("functions, message", [
    ("[]", "is empty: name at least one reward function"),
    ("[rewards.py]", "'rewards.py' is not 'module:function'"),
    ("[my_rewards:ok, 'my rewards:f', 'x:']", "'my rewards:f', 'x:' are not 'module:function'"),
])
def test_functions_are_module_function_entries(registry, functions, message):
    problems = config_problems(registry, *ENV, f"env.reward_functions.functions={functions}")
    assert message in problems["env.reward_functions.functions"]


def test_the_environment_without_functions_is_a_config_error(registry):
    problems = config_problems(registry, *ENV)
    assert "is empty" in problems["env.reward_functions.functions"]


def test_weights_must_be_one_per_function(registry):
    problems = config_problems(registry, *ENV, "env.reward_functions.functions=[m:a, m:b]",
                               "env.reward_functions.weights=[1.0, 2.0, 3.0]")
    assert "3 weights for 2 functions" in problems["env.reward_functions.weights"]


def test_gdpo_weights_are_checked_against_the_functions(registry):
    problems = config_problems(registry, *ENV, "env.reward_functions.functions=[m:a, m:b]",
                               "grpo.adv_estimator.name=gdpo", "grpo.adv_estimator.gdpo.reward_weights=[1, 1, 1]")
    assert "3 weights for the 2 reward components of environment 'reward_functions'" in \
        problems["grpo.adv_estimator.reward_weights"]


def test_gdpo_on_the_single_reward_task_names_the_format_weight(registry):
    problems = config_problems(registry, "grpo.adv_estimator.name=gdpo")
    assert "reports 1" in problems["grpo.adv_estimator.name"]
    assert "env.reverse_digits.format_weight=0.1" in problems["grpo.adv_estimator.name"]
    cfg = load_config(None, ["grpo.adv_estimator.name=gdpo", "env.reverse_digits.format_weight=0.1"], registry)
    assert cfg.env.structured_blocks["reverse_digits"].num_reward_components() == 2


def test_format_weight_must_be_below_one(registry):
    problems = config_problems(registry, "env.reverse_digits.format_weight=1.0")
    assert "env.reverse_digits.format_weight" in problems


# --- finding the functions ------------------------------------------------------------------------


@pytest.mark.parametrize("source, entry, error, message", [
    (None, "nosuch_rewards:f", ConfigError, r"functions\[0\]: 'nosuch_rewards:f': no module 'nosuch_rewards' among "
                                            r"the installed packages or in the current directory"),
    ("def f(completions): return []\n", "rw_missing:g", ConfigError,
     r"'rw_missing:g': module 'rw_missing' has no attribute 'g'"),
    ("LIMIT = 3\n", "rw_constant:LIMIT", ConfigError, r"'rw_constant:LIMIT' is a int, not a function"),
    ("raise RuntimeError('boom at import')\n", "rw_raising:f", PluginError,
     r"importing 'rw_raising' for 'rw_raising:f' raised RuntimeError: boom at import"),
    ("import nosuch_dependency\n", "rw_dependency:f", PluginError, r"No module named 'nosuch_dependency'"),
    ("def f(prompts, completions, /): return []\n", "rw_positional:f", ConfigError,
     r"parameter 'prompts' is positional-only"),
])
def test_an_entry_that_cannot_be_used_is_named(modules, source, entry, error, message):
    module = entry.partition(":")[0]
    if source is not None:
        modules(module, source)
    with pytest.raises(error, match=message):
        RF.RewardFunctionsEnvironment(RewardFunctionsConfig(functions=[entry]), None)


def test_the_current_directory_comes_after_installed_packages(modules):
    modules("json", "def loads(text): return 'the local json.py'\n")
    modules("my_scores", "def score(completions): return [1.0] * len(completions)\n")
    assert callables.resolve("json:loads", "key") is json.loads  # the standard library's, not ./json.py
    env = RF.RewardFunctionsEnvironment(RewardFunctionsConfig(functions=["my_scores:score"]), None)
    assert env.step([plain_log("1>", "1")], [{}]).rewards["score"] == [1.0]
    assert str(__import__("os").getcwd()) not in sys.path  # only for the import


def test_config_validate_imports_the_functions_before_any_run(tmp_path):
    """What the environment would fail on at setup is a config problem at load: `config validate`
    and the start of `run` name the entry, before a model is loaded."""
    (tmp_path / "rw_here.py").write_text("def ok(completions, **kw):\n    return [1.0] * len(completions)\n")
    (tmp_path / "rw_broken.py").write_text("raise RuntimeError('boom at import')\n")
    result = run_grpoctl("config", "validate", *ENV, "data.train_path=x.jsonl",
                         "env.reward_functions.functions=[rw_here:ok, rw_here:missing, rw_broken:f, nomod:f]",
                         cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "functions[0]" not in result.stderr
    assert "functions[1]: 'rw_here:missing': module 'rw_here' has no attribute 'missing'" in result.stderr
    assert "functions[2]: importing 'rw_broken' for 'rw_broken:f' raised RuntimeError: boom at import" in result.stderr
    assert "functions[3]: 'nomod:f': no module 'nomod'" in result.stderr


# --- one step -------------------------------------------------------------------------------------


def test_arguments_follow_each_functions_signature():
    seen = {}

    def everything(prompts, completions, **kwargs):
        seen["everything"] = (prompts, completions, kwargs)
        return [0.0] * len(completions)

    def only_completions(completions):
        seen["only_completions"] = completions
        return [0.0] * len(completions)

    def one_column(completions, answer, unused=None):
        seen["one_column"] = (answer, unused)
        return [0.0] * len(completions)

    env = env_of(everything, only_completions, one_column)
    env.step([plain_log("q1", "a1"), plain_log("q2", "a2")], [{"answer": "1", "n": 1}, {"answer": "2"}])
    assert seen["everything"] == (["q1", "q2"], ["a1", "a2"], {"answer": ["1", "2"], "n": [1, None]})
    assert seen["only_completions"] == ["a1", "a2"]
    assert seen["one_column"] == (["1", "2"], None)


def test_a_function_needing_a_column_the_rows_lack_is_named():
    def needs_answer(completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(EnvironmentStepError, match=r"reward function 'needs_answer' .* needs 'answer', which the rows "
                                                   r"do not have; columns: \['n'\]"):
        env_of(needs_answer).step([plain_log("q", "a")], [{"n": 1}])


def test_components_are_weighted_and_named_after_the_functions():
    def make(value):
        def score(completions):
            return [value] * len(completions)
        return score

    env = env_of(make(1.0), make(0.5), digit_fraction, weights=[2.0, -1.0, 0.5])
    ret = env.step([plain_log("q", "12a")], [{}])
    assert ret.rewards == {"score": [2.0], "score_2": [-0.5], "digit_fraction": [0.5 * 2 / 5]}
    assert ret.metrics == {"none_fraction/score": 0.0, "none_fraction/score_2": 0.0,
                           "none_fraction/digit_fraction": 0.0}


@pytest.mark.parametrize("output, message", [
    ([1.0, 0.0, 1.0], r"'wrong' \(.*\) returned 3 values for 2 completions; it must return one per completion"),
    (1.0, r"'wrong' \(.*\) returned float, not a list of 2 rewards"),
    ("10", r"returned str, not a list of 2 rewards"),
])
def test_a_wrong_number_of_values_names_the_function_and_both_counts(output, message):
    def wrong(completions):
        return output

    with pytest.raises(EnvironmentStepError, match=message):
        env_of(wrong).step([plain_log("q", "a"), plain_log("q", "b")], [{}, {}])


def test_none_is_passed_on_and_counted_per_function():
    ret = env_of(even_only, digit_fraction).step([plain_log("q", "1"), plain_log("q", "2")], [{"n": 0}, {"n": 1}])
    assert ret.rewards["even_only"] == [1.0, None]
    assert ret.metrics["none_fraction/even_only"] == 0.5 and ret.metrics["none_fraction/digit_fraction"] == 0.0


def test_async_functions_run_concurrently():
    async def slow_a(completions):
        await asyncio.sleep(0.2)
        return [1.0] * len(completions)

    async def slow_b(completions):
        await asyncio.sleep(0.2)
        return [2.0] * len(completions)

    env = env_of(slow_a, digit_fraction, slow_b)
    env.step([plain_log("q", "1")], [{}])  # the first step starts the environment's event loop
    start = time.perf_counter()
    ret = env.step([plain_log("q", "1")], [{}])
    elapsed = time.perf_counter() - start
    assert ret.rewards == {"slow_a": [1.0], "digit_fraction": [0.2], "slow_b": [2.0]}
    assert 0.2 <= elapsed < 0.35, f"two 0.2 s async functions took {elapsed:.3f} s: not concurrent"
    env.shutdown()


def test_async_functions_work_when_the_caller_runs_an_event_loop():
    """A notebook cell runs inside the kernel's loop; the functions run on the environment's own."""
    threads = []

    async def where(completions):
        threads.append(threading.current_thread())
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    env = env_of(where)

    async def cell():
        asyncio.get_running_loop()  # this thread's loop is running
        return env.step([plain_log("q", "1")], [{}])

    assert asyncio.run(cell()).rewards == {"where": [1.0]}
    assert threads and threads[0] is not threading.current_thread()
    env.shutdown()


def test_an_async_function_that_raises_is_named():
    async def broken(completions):
        raise KeyError("label")

    with pytest.raises(RF.RewardFunctionError, match=r"reward function 'broken' \(.*\) raised KeyError: 'label'"):
        env_of(broken).step([plain_log("q", "1")], [{}])


def test_conversational_logs_reach_the_functions_as_messages():
    seen = {}

    def record(prompts, completions):
        seen["prompts"], seen["completions"] = prompts, completions
        return [0.0] * len(completions)

    chat = [Message(role="system", content="Be brief."), Message(role="user", content="2+2?"),
            Message(role="assistant", content="4", token_ids=(5,), generation_logprobs=(-0.1,))]
    env_of(record).step([chat, plain_log("12>", "21")], [{}, {}])
    assert seen["prompts"] == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "12>"]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], "21"]


# --- None in the core: "no reward", not a failure -------------------------------------------------


class Fixed:
    def __init__(self, rewards):
        self.rewards = rewards

    def step(self, logs, metadata):
        if len(logs) == 1:  # a retry of one sample: its own values
            i = int(logs[0][0].content)
            return EnvironmentReturn(rewards={k: [v[i]] for k, v in self.rewards.items()})
        return EnvironmentReturn(rewards=self.rewards)


def test_a_step_keeps_none_per_component_and_names_a_non_finite_reward():
    logs = [plain_log(str(i), "r") for i in range(3)]
    env = Fixed({"a": [1.0, None, None], "b": [None, 0.5, None]})
    results, names, _ = step_environment(env, "fixed", logs, [{}] * 3, ["row 0", "row 1", "row 2"], on_error="raise")
    assert names == ["a", "b"] and all(r.failure is None for r in results)
    assert [r.rewards for r in results] == [{"a": 1.0, "b": None}, {"a": None, "b": 0.5}, {"a": None, "b": None}]
    with pytest.raises(EnvironmentStepError, match=r"sample 1 \(row 1, prompt '1'.*reward 'a' is nan"):
        step_environment(Fixed({"a": [1.0, math.nan, None]}), "fixed", logs, [{}] * 3, ["row 0", "row 1", "row 2"],
                         "raise")


def test_samples_without_reward_leave_the_loss_and_are_counted(registry, tmp_path, tiny_model_dir):
    data = write_digits(tmp_path / "d.jsonl")
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, *ENV, f"data.train_path={data}",
                            "env.reward_functions.functions=[test_reward_functions:even_only]", "data.shuffle=false",
                            "grpo.num_generations_per_prompt=2")
    metrics, batch = trainer.train_step()
    # rows 0..3, two samples each: n = 1 and 3 have no reward, and leave the loss
    assert batch.reward_valid.tolist() == [True, True, False, False] * 2
    assert batch.sample_mask.tolist() == [1.0, 1.0, 0.0, 0.0] * 2
    assert metrics["reward/num_no_reward"] == 4 and metrics["reward/num_failed"] == 0
    assert metrics["reward/mean"] == 1.0 and metrics["env/none_fraction/even_only"] == 0.5
    assert math.isfinite(metrics["loss"])
    trainer.shutdown()


def test_a_step_without_any_reward_trains_nothing_and_does_not_fail(registry, tmp_path, tiny_model_dir):
    data = write_digits(tmp_path / "d.jsonl")
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, *ENV, f"data.train_path={data}",
                            "env.reward_functions.functions=[test_reward_functions:never]")
    before = {k: v.clone() for k, v in trainer.components.policy.model.state_dict().items()}
    metrics, _ = trainer.train_step()
    assert metrics["reward/num_no_reward"] == 16 and metrics["reward/num_failed"] == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.components.policy.model.state_dict().items())
    trainer.shutdown()


# --- failures through the trainer -----------------------------------------------------------------


def test_a_raising_function_names_the_sample_and_the_function(registry, tmp_path, tiny_model_dir):
    rows = [{"prompt": f"{d}2345>", "target": f"5432{d}"} for d in "1357"]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, *ENV, f"data.train_path={data}",
                            "data.shuffle=false", "env.reward_functions.functions=[test_reward_functions:no_sevens]")
    with pytest.raises(EnvironmentStepError, match=r"'reward_functions' failed on sample 12 \(.*d.jsonl line 4, prompt "
                                                   r"'72345>'.*RewardFunctionError: reward function 'no_sevens' "
                                                   r"\(test_reward_functions:no_sevens\) raised ValueError: cannot "
                                                   r"score a 7"):
        trainer.train_step()
    trainer.shutdown()


def test_a_stuck_function_stops_the_run_at_the_call_deadline(registry, tmp_path, tiny_model_dir):
    data = write_digits(tmp_path / "d.jsonl")
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, *ENV, f"data.train_path={data}",
                            "env.reward_functions.functions=[test_reward_functions:stuck]", "cluster.call_timeout_s=1")
    start = time.perf_counter()
    with pytest.raises(EnvironmentStepError, match=r"did not return a reward for sample 0 .* within 1 s "
                                                   r"\(cluster.call_timeout_s\)"):
        trainer.train_step()
    assert time.perf_counter() - start < 10  # the batch's deadline, then sample 0's
    trainer.shutdown()


# --- callables through the Python API ---------------------------------------------------------------


def test_a_module_function_is_referenced_by_name():
    assert callables.reference_for(exact) == "test_reward_functions:exact"


def test_a_script_or_notebook_function_is_referenced_in_main(monkeypatch):
    main = types.ModuleType("__main__")
    exec("def my_reward(completions):\n    return [1.0] * len(completions)\n", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert callables.reference_for(main.my_reward) == "__main__:my_reward"
    with pytest.raises(ConfigError, match=r"'__main__:gone'.*defined in the script or notebook that started the run; "
                                          r"pass it again through the Python API"):
        callables.resolve("__main__:gone", "env.reward_functions.functions[0]")


def test_a_lambda_gets_a_process_local_reference_that_round_trips_through_the_config(registry, tmp_path):
    reward = lambda completions, **kw: [0.25] * len(completions)  # noqa: E731
    reference = callables.reference_for(reward)
    assert reference.startswith("callable:lambda#") and callables.reference_for(reward) == reference
    cfg = load_config(None, [*ENV, f"env.reward_functions.functions=['{reference}']", "data.train_path=d.jsonl"],
                      registry)
    resolved = tmp_path / "config.resolved.yaml"
    resolved.write_text(to_yaml(cfg))
    again = load_config([str(resolved)], [], registry)
    assert again.env.structured_blocks["reward_functions"].functions == [reference]
    env = RF.RewardFunctionsEnvironment(again.env.structured_blocks["reward_functions"], None)
    assert env.step([plain_log("q", "a")], [{}]).rewards == {"lambda": [0.25]}


def test_a_process_local_reference_from_another_process_says_what_to_do():
    with pytest.raises(ConfigError, match=r"'callable:reward#999' is a reward function passed as a Python object to "
                                          r"another process.*Pass it again through the Python API, or define it in a "
                                          r"module and name it 'module:function'"):
        RF.RewardFunctionsEnvironment(RewardFunctionsConfig(functions=["callable:reward#999"]), None)


# --- training with reward functions ---------------------------------------------------------------


def test_gdpo_weighs_two_functions(registry, tmp_path, tiny_model_dir):
    data = write_digits(tmp_path / "d.jsonl")
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, *ENV, f"data.train_path={data}",
                            "env.reward_functions.functions=[test_reward_functions:exact, "
                            "test_reward_functions:digit_fraction]", "env.reward_functions.weights=[1.0, 0.5]",
                            "grpo.adv_estimator.name=gdpo", "grpo.adv_estimator.gdpo.reward_weights=[1.0, 2.0]")
    seen = spy_on_estimator(trainer)
    metrics, rollouts = trainer.train_step()
    assert sorted(seen["components"]) == ["digit_fraction", "exact"]
    fractions = torch.tensor([digit_fraction([log[-1].content])[0] for log in rollouts.message_logs])
    assert torch.allclose(rollouts.reward_components["digit_fraction"], 0.5 * fractions)
    assert metrics["reward/digit_fraction"] == pytest.approx(float(0.5 * fractions.mean()))
    trainer.shutdown()


def spy_on_estimator(trainer) -> dict:
    """Record the reward components the estimator gets, and what it would answer without the
    ``format``/``digit_fraction`` one (zeroed): the advantages must depend on both."""
    estimator, seen = trainer.components.estimator, {}
    compute = estimator.compute_advantages

    def spy(batch):
        components = batch.reward_components
        seen["components"] = dict(components)
        out = compute(batch)
        for name in components:
            zeroed = {**components, name: torch.zeros_like(components[name])}
            seen[f"without {name}"] = compute(attrs.evolve(batch, reward_components=zeroed))
        seen["advantages"] = out
        return out

    estimator.compute_advantages = spy
    return seen


def test_conversational_rows_train_and_reach_the_functions_as_messages(registry, tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # The characters of the built-in tokenizer only: a template that renders the user turns' content.
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}" \
                              "{% endif %}{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "chat_tokenizer")
    rows = [{"messages": [{"role": "system", "content": "reverse"}, {"role": "user", "content": f"{d}>"}],
             "target": d[::-1]} for d in ("12345", "67890", "13579", "24680")]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, *ENV, f"data.train_path={data}",
                            f"policy.tokenizer.name={tmp_path / 'chat_tokenizer'}", "data.shuffle=false",
                            "env.reward_functions.functions=[test_reward_functions:recorded]")
    RECORDED.clear()
    metrics, rollouts = trainer.train_step()  # the step record, a TrainBatch
    prompts, completions, target = RECORDED[0]
    assert prompts[0] == [{"role": "system", "content": "reverse"}, {"role": "user", "content": "12345>"}]
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    assert target[:4] == ["54321"] * 4
    log = rollouts.message_logs[0]
    assert [m.role for m in log] == ["system", "user", "assistant"] and log[1].token_ids == ()
    assert log[2].token_ids and len(log[2].generation_logprobs) == len(log[2].token_ids)
    assert completions[0][0]["content"] == log[2].content
    # the model saw the chat template's rendering: <bos> then the user turn
    prompt = slice(0, rollouts.response_start)
    first = rollouts.input_ids[0][prompt][rollouts.attention_mask[0][prompt].bool()].tolist()
    assert first == tokenizer("12345>", add_special_tokens=True)["input_ids"]
    rollouts.rewards = torch.zeros(rollouts.batch_size)
    assert example_of(rollouts)["prompt"] == "12345>"  # the last turn before the response
    trainer.shutdown()


RECORDED: list = []


def recorded(prompts, completions, target):
    RECORDED.append((prompts, completions, target))
    return [float(c[0]["content"] == t) for c, t in zip(completions, target)]


def test_a_reward_function_module_trains_from_the_cli(tmp_path):
    """The story of the guide: a JSONL of prompts, a 5-line reward function, grpoctl run."""
    write_digits(tmp_path / "train.jsonl", count=256)
    (tmp_path / "my_rewards.py").write_text(
        "def digits(completions, **kwargs):\n"
        "    return [sum(ch.isdigit() for ch in c) / 5 for c in completions]\n")
    result = run_grpoctl("run", "--run-dir", "run", "env.name=reward_functions",
                         "env.reward_functions.functions=[my_rewards:digits]", "data.train_path=train.jsonl",
                         "grpo.max_num_steps=30", "grpo.val_at_end=false", "grpo.val_period=0",
                         "checkpointing.enabled=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.1, f"reward {first:.3f} -> {last:.3f}: the policy should learn to answer in digits"
    assert all(r["reward/digits"] == r["reward/mean"] for r in rows)


def test_a_missing_reward_function_is_a_config_error_from_the_cli(tmp_path):
    write_digits(tmp_path / "train.jsonl")
    (tmp_path / "my_rewards.py").write_text("def digits(completions):\n    return [0.0] * len(completions)\n")
    result = run_grpoctl("run", "--run-dir", "run", "env.name=reward_functions",
                         "env.reward_functions.functions=[my_rewards:digit]", "data.train_path=train.jsonl",
                         "grpo.val_at_end=false", "grpo.val_period=0", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "env.reward_functions.functions[0]: 'my_rewards:digit': module 'my_rewards' has no attribute 'digit'" \
        in result.stderr


# --- the built-in multi-reward task ---------------------------------------------------------------


@pytest.mark.parametrize("answer", ["54321", "54320", "5432", "543210", "5a321", ""])
def test_reverse_digits_format_component(answer):
    log = plain_log("12345>", answer)
    plain = ReverseDigitsEnvironment(ReverseDigitsConfig(), None).step([log], [{"target": "54321"}])
    assert plain.rewards == {"correct_digits": [correct_positions(answer, "54321")]}
    ret = ReverseDigitsEnvironment(ReverseDigitsConfig(format_weight=0.1), None).step([log], [{"target": "54321"}])
    formatted = len(answer) == 5 and answer.isdigit()
    assert ret.rewards["correct_digits"] == [pytest.approx(0.9 * correct_positions(answer, "54321"))]
    assert ret.rewards["format"] == [0.1 if formatted else 0.0]
    total = ret.rewards["correct_digits"][0] + ret.rewards["format"][0]
    assert (total >= 1.0) == (answer == "54321")  # validation's pass_k still counts exact answers only
    assert ret.metrics["format_fraction"] == float(formatted)


def test_gdpo_uses_both_components_of_the_built_in_task(registry, tmp_path, tiny_model_dir):
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "grpo.adv_estimator.name=gdpo",
                            "env.reverse_digits.format_weight=0.1", "grpo.num_prompts_per_step=16",
                            "grpo.num_generations_per_prompt=16")
    seen = spy_on_estimator(trainer)
    trainer.train_step()
    assert sorted(seen["components"]) == ["correct_digits", "format"]
    assert seen["components"]["format"].unique().numel() == 2  # some answers are well-formed, some not
    for name in ("correct_digits", "format"):
        assert not torch.allclose(seen["advantages"], seen[f"without {name}"]), f"{name} does not change the advantages"
    trainer.shutdown()


@pytest.mark.slow
def test_every_built_in_estimator_trains_from_the_cli_on_the_built_in_task(registry, tmp_path):
    """Each estimator `grpoctl plugins list` shows, on reverse_digits with its format component (gdpo
    needs two); one that needs a teacher (opd) distils from a short grpo run's checkpoint."""
    from grpo_sdk.core.capabilities import Capability

    estimators = {info.name: info for info in registry.list("estimator") if info.dist == "grpo-sdk"}
    assert set(estimators) >= {"grpo", "rloo", "reinforce_plus_plus", "gdpo", "opd"}
    common = ["grpo.max_num_steps=3", "grpo.num_prompts_per_step=4", "grpo.val_period=0", "grpo.val_at_end=false",
              "env.reverse_digits.format_weight=0.1"]
    teacher = None
    for name in sorted(estimators, key=lambda n: Capability.TEACHER_LOGPROBS in estimators[n].spec.capabilities):
        extra = []
        if Capability.TEACHER_LOGPROBS in estimators[name].spec.capabilities:
            assert teacher is not None and teacher.is_dir()
            extra = [f"on_policy_distillation.teacher_model={teacher}"]
        result = run_grpoctl("run", "--run-dir", name, f"grpo.adv_estimator.name={name}", *common, *extra, cwd=tmp_path)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3], name
        assert all(math.isfinite(r["loss"]) and "reward/format" in r for r in rows), name
        if name == "grpo":
            teacher = tmp_path / name / "checkpoints" / "step_3" / "policy"
