"""The selected components: what each declares (``capabilities_of``), and each one's own check of
its options against the rest of the config (``ComponentSpec.check``)."""

from __future__ import annotations

from typing import Any

import attrs

from grpo_sdk.config import schema as C
from grpo_sdk.core.capabilities import Capability
from grpo_sdk.core.errors import PluginError
from grpo_sdk.core.imports import import_target


def capabilities_of(registry: Any, kind: str, name: str) -> frozenset[Capability]:
    """What the ``kind`` component ``name`` declares in its spec; none without a registry or a spec."""
    info = registry.info(kind, name) if registry is not None else None
    return info.spec.capabilities if info is not None and info.spec is not None else frozenset()


def selected_components(cfg: Any, prefix: str = "") -> list[tuple[str, str, str, Any]]:
    """``(kind, name, key path of its block, its options)`` of every component the config selects."""
    found = []
    for field in attrs.fields(type(cfg)):
        value = getattr(cfg, field.name)
        if not attrs.has(type(value)):
            continue
        path = f"{prefix}{field.name}"
        slot = getattr(type(value), "__plugin__", None)
        if slot is not None:
            selected = getattr(value, slot.selector)
            for name in (selected if slot.many else [selected]):
                found.append((slot.kind, name, f"{path}.{name}", C.plugin_config(value, name)))
        found += selected_components(value, f"{path}.")
    return found


def check_components(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """Each selected component's own check of its options against the rest of the config
    (``ComponentSpec.check``). A check that raises is reported as that plugin's problem, except a
    ``PluginError``: the component cannot be used here (an engine not installed, no GPU for it),
    raised after the other checks as the selector's problem, so the command exits 3."""
    problems: list[tuple[str, str]] = []
    unusable: list[str] = []
    for kind, name, path, options in selected_components(cfg) if registry is not None else []:
        info = registry.info(kind, name)
        target = getattr(info.spec, "check", None) if info is not None and info.spec is not None else None
        if target is None:
            continue
        try:
            problems += [(key, message) for key, message in import_target(target)(cfg, options, registry)]
        except PluginError as exc:
            unusable.append(f"{path}: {exc}")
        except Exception as exc:  # a plugin's bug must not become a traceback of `config validate`
            problems.append((path, f"the option check of {kind} {name!r} ({target}) failed: "
                             f"{type(exc).__name__}: {exc}"))
    if unusable:
        raise PluginError("\n".join(unusable))
    return problems
