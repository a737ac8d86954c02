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
    # receives_broadcast: the collective transport drives SGLang's own weight-update group
    # (/init_weights_update_group + /update_weights_from_distributed). in_flight_weight_updates: server
    # mode (/pause_generation in_place | retract, per-token versions from meta_info.weight_versions);
    # the check refuses it in engine mode. Not declared: cuda_ipc (update_weights re-shares CUDA
    # tensors over IPC itself).
    capabilities={"receives_broadcast", "in_flight_weight_updates"},
    summary="Generation on SGLang: a running server over HTTP, or sglang.Engine in this process.",
)
