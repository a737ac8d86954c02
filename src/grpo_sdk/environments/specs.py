"""Entry-point targets and config classes of the built-in environments.

Capability ``generates_prompts``: the environment implements ``sample_prompts(n, rng)``, so a run
needs no dataset (synthetic tasks), for training or validation.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MAX_THREADS
from grpo_sdk.plugins import ComponentSpec


@attrs.frozen(kw_only=True)
class ReverseDigitsConfig:
    num_digits: int = option(5, "Length of the digit strings to reverse; 8 is a harder variant.",
                             validator=[attrs.validators.gt(0), attrs.validators.le(10_000)])  # a prompt must fit a context
    format_weight: float = option(0.0, "Share of the reward given to the answer's format (exactly num_digits "
                                  "digits), as a second component `format`; `correct_digits` gets the rest. "
                                  "0 reports `correct_digits` alone; 0.1 gives gdpo two components.",
                                  validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])

    def num_reward_components(self) -> int:
        return 2 if self.format_weight > 0 else 1


REVERSE_DIGITS = ComponentSpec(
    name="reverse_digits",
    kind="environment",
    impl="grpo_sdk.environments.reverse_digits:ReverseDigitsEnvironment",
    config="grpo_sdk.environments.specs:ReverseDigitsConfig",
    capabilities={"generates_prompts"},
    metrics={"exact_match", "format_fraction"},
    summary="Synthetic task: reverse a digit string; partial credit per correct position (and, with "
            "format_weight, a format component).",
)


@attrs.frozen(kw_only=True)
class MathEnvConfig:
    answer_key: str = option("answer", "Key of the gold answer in each row's metadata (a number, a LaTeX "
                             "expression, or a GSM8K solution ending in '#### <answer>').")
    plain_answer_fallback: bool = option(True, "When a response has no \\boxed{} answer, take its plain final "
                                         "answer: after the last '####', else after the last 'answer is' / "
                                         "'answer:', else its last number. False: only \\boxed{} counts.")
    timeout_seconds: int = option(5, "Seconds math-verify may spend parsing or comparing one answer; one that "
                                  "runs out scores 0 (a pathological expression cannot stall the run).",
                                  validator=attrs.validators.gt(0))
    num_workers: int = option(0, "Processes that score responses in parallel; 0 scores in the calling process. "
                              "math-verify's timeouts need the main thread, so a call from another thread "
                              "uses one worker process even when this is 0.",
                              validator=[attrs.validators.ge(0), attrs.validators.le(MAX_THREADS)])


MATH = ComponentSpec(
    name="math",
    kind="environment",
    impl="grpo_sdk.environments.math_env:MathEnvironment",
    config="grpo_sdk.environments.specs:MathEnvConfig",
    requires=("math-verify>=0.7",),
    extra="math",
    metrics={"extracted_fraction", "boxed_fraction"},
    summary="Math word problems: reward 1 when the final answer (\\boxed{} or plain) equals the gold answer "
            "under math-verify.",
)


# "module:function" (dotted on both sides: "pkg.rewards:Rewards.score"), or a process-local
# reference to a callable passed through the Python API ("callable:<name>#<n>").
FUNCTION_ENTRY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
LOCAL_REFERENCE = re.compile(r"^callable:[^#\s]+#\d+$")


NO_FUNCTIONS = "is empty: name at least one reward function as 'module:function', e.g. [my_rewards:correctness]"


def _check_functions(instance: Any, attribute: Any, value: list[str]) -> None:
    # An empty list is check_reward_functions' to report: attrs validates an absent key's default
    # too, and would name the block rather than the key.
    bad = [entry for entry in value if not (FUNCTION_ENTRY.match(entry) or LOCAL_REFERENCE.match(entry))]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not 'module:function' "
                         "(a module importable from the current directory or an installed package, and a "
                         "function in it), e.g. my_rewards:correctness")


@attrs.frozen(kw_only=True)
class RewardFunctionsConfig:
    functions: list[str] = option(factory=list, validator=_check_functions, help=(
        "Reward functions, each 'module:function' (the module importable from the current directory or an "
        "installed package), called as fn(prompts, completions, **columns) -> one float (or None) per "
        "completion; each is a reward component named after the function."))
    weights: list[float] | None = option(None, "Weight of each function's reward, in the order of functions; "
                                         "null weighs all 1.0. The total reward is the weighted sum.")

    def num_reward_components(self) -> int:
        return len(self.functions)


def check_reward_functions(config: Any, options: RewardFunctionsConfig | None, registry: Any) -> list[tuple[str, str]]:
    if options is None or not options.functions:  # a default is not validated: an absent key lands here
        return [("env.reward_functions.functions", NO_FUNCTIONS)]
    problems = []
    if options.weights is not None and len(options.weights) != len(options.functions):
        problems.append(("env.reward_functions.weights", f"{len(options.weights)} weights for "
                         f"{len(options.functions)} functions (env.reward_functions.functions); give one weight "
                         "per function, in the same order, or null for all 1.0"))
    # Imported now, so `config validate` and the start of `run` find a missing module or function,
    # not the first step after the model loaded.
    from grpo_sdk.environments.reward_functions import KEY, resolve
    from grpo_sdk.plugins import ConfigError, PluginError

    for i, entry in enumerate(options.functions):
        key = f"{KEY}[{i}]"
        try:
            resolve(entry, key)
        except ConfigError as exc:
            problems.extend((key, message) for _, message in exc.problems)
        except PluginError as exc:  # the user's module raised while it was imported
            problems.append((key, str(exc).removeprefix(f"{key}: ")))
    return problems


REWARD_FUNCTIONS = ComponentSpec(
    name="reward_functions",
    kind="environment",
    impl="grpo_sdk.environments.reward_functions:RewardFunctionsEnvironment",
    config="grpo_sdk.environments.specs:RewardFunctionsConfig",
    check="grpo_sdk.environments.specs:check_reward_functions",
    summary="Rewards from plain Python functions fn(prompts, completions, **columns) named 'module:function'; "
            "one weighted component each.",
)
