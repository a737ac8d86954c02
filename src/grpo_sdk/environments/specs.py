"""Entry-point targets and config classes of the built-in environments.

Capability ``generates_prompts``: the environment implements ``sample_prompts(n, rng)``, so a run
needs no dataset (synthetic tasks), for training or validation.
"""

from __future__ import annotations

import attrs

from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MAX_THREADS
from grpo_sdk.plugins import ComponentSpec


@attrs.frozen(kw_only=True)
class ReverseDigitsConfig:
    num_digits: int = option(5, "Length of the digit strings to reverse; 8 is a harder variant.",
                             validator=[attrs.validators.gt(0), attrs.validators.le(10_000)])  # a prompt must fit a context


REVERSE_DIGITS = ComponentSpec(
    name="reverse_digits",
    kind="environment",
    impl="grpo_sdk.environments.reverse_digits:ReverseDigitsEnvironment",
    config="grpo_sdk.environments.specs:ReverseDigitsConfig",
    capabilities={"generates_prompts"},
    metrics={"exact_match"},
    summary="Synthetic task: reverse a digit string; partial credit per correct position.",
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
