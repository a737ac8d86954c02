"""Entry-point targets of the hf backend (light: no torch here)."""

from typing import Any

from grpo_sdk.plugins import ComponentSpec
from grpo_sdk.plugins.toolkit import require_engine

GENERATION = ComponentSpec(
    name="hf",
    kind="generation",
    impl="grpo_sdk.backends.hf.generation:HFGeneration",
    config="grpo_sdk.backends.hf.config:HFGenerationConfig",
    requires=("torch", "transformers"),
    capabilities={"cuda_ipc", "in_flight_weight_updates"},
    summary="Batched KV-cache sampling with transformers models (CPU or one GPU).",
)

POLICY = ComponentSpec(
    name="hf",
    kind="policy",
    impl="grpo_sdk.backends.hf.policy:HFPolicy",
    config="grpo_sdk.backends.hf.config:HFPolicyConfig",
    check="grpo_sdk.backends.hf.spec:check_policy",
    requires=("torch", "transformers"),
    summary="Training of transformers causal LMs: micro-batches, AdamW, grad clipping, LR schedule.",
)


def check_policy(config: Any, options: Any, registry: Any) -> list[tuple[str, str]]:
    """LoRA needs peft: not installed is a PluginError (exit 3) with the install line, before any model
    loads. The target module names are checked against the model when it is built."""
    if config.policy.lora.enabled:
        require_engine("peft", "policy.lora.enabled=true needs it: pip install 'grpo-sdk[lora]'", gpu=False)
    return []
