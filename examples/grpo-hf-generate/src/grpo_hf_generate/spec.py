"""The entry-point target: light, so `grpoctl plugins list` never imports torch for it."""

import attrs

from grpo_sdk.plugins import ComponentSpec, option


@attrs.frozen(kw_only=True)
class HFGenerateConfig:
    num_beams: int = option(1, "Beams for model.generate; 1 samples (GRPO needs sampling).",
                            validator=attrs.validators.in_([1]))


SPEC = ComponentSpec(
    name="hf_generate",
    kind="generation",
    impl="grpo_hf_generate.generation:HFGenerateGeneration",
    config="grpo_hf_generate.spec:HFGenerateConfig",
    requires=("transformers>=4.50",),
    api=1,  # the plugin API this is written against
    summary="Sampling through transformers' model.generate (example plugin).",
)
