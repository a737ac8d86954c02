"""Entry-point targets of the hf backend (light: no torch here)."""

from grpo_sdk.plugins import ComponentSpec

GENERATION = ComponentSpec(
    name="hf",
    kind="generation",
    impl="grpo_sdk.backends.hf.generation:HFGeneration",
    config="grpo_sdk.backends.hf.config:HFGenerationConfig",
    check="grpo_sdk.backends.hf.config:check_generation",
    requires=("torch", "transformers"),
    capabilities={"cuda_ipc", "in_flight_weight_updates"},
    summary="Batched KV-cache sampling with transformers models (CPU or one GPU).",
)

POLICY = ComponentSpec(
    name="hf",
    kind="policy",
    impl="grpo_sdk.backends.hf.policy:HFPolicy",
    config="grpo_sdk.backends.hf.config:HFPolicyConfig",
    check="grpo_sdk.backends.hf.config:check_policy",
    requires=("torch", "transformers"),
    capabilities={"dynamic_batching", "sequence_packing", "logprob_chunks"},
    summary="Training of transformers causal LMs: micro-batches, AdamW, grad clipping, LR schedule.",
)

