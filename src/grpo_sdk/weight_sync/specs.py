"""Entry-point targets of the built-in weight-sync transports."""

from grpo_sdk.plugins import ComponentSpec

INPROCESS = ComponentSpec(
    name="inprocess",
    kind="weight_sync",
    impl="grpo_sdk.weight_sync.inprocess:InProcessWeightSync",
    capabilities={"inprocess"},
    summary="Hands the policy's tensors to the generation backend in the same process.",
)
