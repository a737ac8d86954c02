"""Entry-point target of the Dynamo backend (light: no torch, nothing of Dynamo is imported anywhere).

The backend is an HTTP client of a deployment someone else started, so nothing needs installing
and there is no GPU check here (docs/dynamo.md, "Install"): the engine runs elsewhere.
"""

from grpo_sdk.plugins import ComponentSpec

GENERATION = ComponentSpec(
    name="dynamo",
    kind="generation",
    impl="grpo_sdk.backends.dynamo.generation:DynamoGeneration",
    config="grpo_sdk.backends.dynamo.config:DynamoConfig",
    check="grpo_sdk.backends.dynamo.config:check_options",
    # The workers join the collective transport's group through their refit routes. Not
    # in_flight_weight_updates: NeMo-RL refuses them for Dynamo (layerwise reload is not safe
    # under running requests), so pause_generation drains.
    capabilities={"receives_broadcast"},
    summary="Generation through a running NVIDIA Dynamo deployment (OpenAI frontend + vLLM workers' refit routes).",
)
