"""Entry-point targets and config classes of the built-in environments.

Capability ``generates_prompts``: the environment implements ``sample_prompts(n, rng)``, so a run
needs no dataset (synthetic tasks), for training or validation.
"""

from __future__ import annotations

import attrs

from grpo_sdk.core.config import option
from grpo_sdk.plugins import ComponentSpec


@attrs.frozen(kw_only=True)
class ReverseDigitsConfig:
    num_digits: int = option(5, "Length of the digit strings to reverse; 8 is a harder variant.",
                             validator=attrs.validators.gt(0))


REVERSE_DIGITS = ComponentSpec(
    name="reverse_digits",
    kind="environment",
    impl="grpo_sdk.environments.reverse_digits:ReverseDigitsEnvironment",
    config="grpo_sdk.environments.specs:ReverseDigitsConfig",
    capabilities={"generates_prompts"},
    summary="Synthetic task: reverse a digit string; partial credit per correct position.",
)
