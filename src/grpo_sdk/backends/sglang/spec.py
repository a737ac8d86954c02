"""Entry-point target of the SGLang backend (light: no sglang or torch import here)."""

from grpo_sdk.plugins import ComponentSpec

GENERATION = ComponentSpec(
    name="sglang",
    kind="generation",
    impl="grpo_sdk.backends.sglang.generation:SGLangGeneration",
    config="grpo_sdk.backends.sglang.config:SGLangConfig",
    check="grpo_sdk.backends.sglang.config:check_options",
    # Server mode needs nothing installed here (the engine runs elsewhere); engine mode needs the
    # wheel, and the check says so (exit 3) before anything starts.
    requires=(),
    extra="sglang",
    # The collective transport drives SGLang's own weight-update group (/init_weights_update_group +
    # /update_weights_from_distributed). Not declared: in_flight_weight_updates (the check refuses it,
    # docs/sglang.md says why) and cuda_ipc (update_weights re-shares CUDA tensors itself).
    capabilities={"receives_broadcast"},
    summary="Generation on SGLang: a running server over HTTP, or sglang.Engine in this process.",
)
