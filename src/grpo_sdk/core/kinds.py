"""The component kinds, declared once. A new kind is one entry in ``COMPONENT_KINDS``.

Everything that lists kinds derives from this table: the entry-point groups
(``grpo_sdk.plugins.KINDS``), the labels in messages (``plugins list``, conflicts), the protocol
the contract kit checks, the pluggable config sections and their selector keys (``grpo_sdk.config.schema``),
and what ``grpoctl plugins new`` writes into a project's README.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ComponentKind:
    name: str  # what specs and the CLI call it: ComponentSpec.kind, `plugins new --kind`
    group: str  # the entry-point group its specs are registered in
    label: str  # how messages name one: "generation backend 'vllm'"
    protocol_name: str  # its protocol in grpo_sdk.core.protocols
    section: str  # the config section holding its blocks, e.g. "policy.generation"
    selector: str  # the key of that section that names the selected component(s)
    many: bool = False  # the selector holds a list of names (loggers)

    @property
    def selector_key(self) -> str:
        """The full config key that selects it, e.g. ``policy.generation.backend``."""
        return f"{self.section}.{self.selector}"

    @property
    def protocol(self) -> Any:
        from grpo_sdk.core import protocols  # light, but not needed by config loading

        return getattr(protocols, self.protocol_name)


COMPONENT_KINDS = (
    ComponentKind(name="generation", group="grpo_sdk.generation", label="generation backend",
                  protocol_name="Generation", section="policy.generation", selector="backend"),
    ComponentKind(name="policy", group="grpo_sdk.policy", label="policy backend", protocol_name="Policy",
                  section="policy", selector="backend"),
    ComponentKind(name="estimator", group="grpo_sdk.estimators", label="advantage estimator",
                  protocol_name="AdvantageEstimator", section="grpo.adv_estimator", selector="name"),
    ComponentKind(name="environment", group="grpo_sdk.environments", label="environment",
                  protocol_name="Environment", section="env", selector="name"),
    ComponentKind(name="weight_sync", group="grpo_sdk.weight_sync", label="weight-sync transport",
                  protocol_name="WeightSync", section="weight_sync", selector="backend"),
    ComponentKind(name="logger", group="grpo_sdk.loggers", label="logger", protocol_name="Logger",
                  section="logger", selector="loggers", many=True),
)

KIND = {kind.name: kind for kind in COMPONENT_KINDS}
"""Kind name -> its ComponentKind."""
