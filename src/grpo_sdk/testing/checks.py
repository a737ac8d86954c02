"""The contract kit's static checks: the spec (``check_spec``, ``check_light``), the config
(``check_config``) and the protocol (``check_protocol``), with the vocabulary the kit shares
(``Component``, ``ContractError``, ``SELECTORS``, ``PROTOCOLS``).

A module of its own because none of these runs a training step: they read the registry, load a
config and inspect signatures. ``grpo_sdk.testing`` re-exports the public names; plugin packages
import them from there.
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Iterable

import attrs

from grpo_sdk.core import protocols
from grpo_sdk.core.agents import RunsAgents
from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.core.kinds import COMPONENT_KINDS
from grpo_sdk.core.multi_turn import DeclaresTools
from grpo_sdk.plugins.advantage_calls import API1_CALL
from grpo_sdk.plugins.registry import KIND_LABELS, Registry
from grpo_sdk.plugins.specs import KINDS, ComponentSpec

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig


SELECTORS: dict[str, str] = {kind.name: kind.selector_key for kind in COMPONENT_KINDS}
"""Component kind -> the config key that selects it (``logger.loggers`` is a list)."""

PROTOCOLS: dict[str, type] = {kind.name: kind.protocol for kind in COMPONENT_KINDS}
"""Component kind -> the protocol its implementation must satisfy."""

HEAVY_MODULES = ("torch", "transformers", "vllm", "ray")


@attrs.frozen
class Component:
    """One component to check: ``kind``, ``name`` and config overrides for its training run."""

    kind: str
    name: str
    overrides: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


def parse_component(text: str) -> Component:
    """``"estimator:acme env.name=two_rewards"`` -> Component; raises ValueError when malformed."""
    head, *overrides = shlex.split(text)
    kind, sep, name = head.partition(":")
    if not sep or not name:
        raise ValueError(f"{text!r}: expected 'kind:name' followed by optional overrides, e.g. 'generation:acme'")
    if kind not in KINDS:
        raise ValueError(f"{text!r}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    return Component(kind, name, overrides)


class ContractError(AssertionError):
    """A component does not fit: the message says what is wrong and how to fix it."""


def _label(kind: str, name: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    return f"{KIND_LABELS[kind]} {name!r}"


# --- spec -----------------------------------------------------------------------------------------


def check_spec(kind: str, name: str, *, registry: Registry | None = None) -> ComponentSpec:
    """The component's spec: discovered, status ok, its entry point named after it.

    On failure the AssertionError carries the registry's own message (what ``grpoctl run``
    would print), e.g. "... is installed but failed to load: ModuleNotFoundError: ...".
    """
    label = _label(kind, name)
    registry = registry or Registry.discover()
    info = registry.info(kind, name)
    if info is None:
        known = ", ".join(registry.names(kind)) or "none"
        raise ContractError(f"no {label} is installed (known: {known}). Install the package that provides it "
                    f"(`pip install -e .` in a plugin project) and check its "
                    f'[project.entry-points."{KINDS[kind]}"] table in pyproject.toml')
    try:
        spec = registry.get(kind, name)
    except GrpoSdkError as exc:
        raise ContractError(str(exc)) from None
    if spec.name != name or spec.kind != kind:  # the registry marks this broken; say it plainly anyway
        raise ContractError(f"the entry point {name!r} names the spec of {spec.kind} {spec.name!r}: "
                    "the entry-point name must equal SPEC.name")
    return spec


def check_light(kind: str, name: str, *, registry: Registry | None = None) -> list[str]:
    """Importing the spec's module and its config module imports no torch (nor transformers,
    vllm, ray): discovery imports every installed spec. Checked in a fresh interpreter; returns
    the modules it imported."""
    registry = registry or Registry.discover()
    spec = check_spec(kind, name, registry=registry)
    info = registry.info(kind, name)
    modules = [target.partition(":")[0] for target in (info.entry_point, spec.config) if target]
    modules = list(dict.fromkeys(modules))
    if not modules:  # registered in-process without a config class: nothing is imported by discovery
        return []
    code = (
        "import importlib, json, sys\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
        f"print(json.dumps(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules)))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise ContractError(f"importing {', '.join(modules)} failed:\n{result.stderr.strip()[-2000:]}")
    heavy = json.loads(result.stdout.strip().splitlines()[-1])
    if heavy:
        raise ContractError(f"importing the spec of {_label(kind, name)} ({', '.join(modules)}) imports {', '.join(heavy)}: "
                    "discovery (`grpoctl plugins list`) imports every installed spec, so spec and config modules "
                    "must stay light. Import heavy modules only in the implementation module (also check the "
                    "package's __init__.py)")
    return modules


# --- config ---------------------------------------------------------------------------------------


def undocumented_options(cls: type, prefix: str = "") -> list[str]:
    """Options of an attrs config class (and its nested sections) without help text."""
    attrs.resolve_types(cls)
    missing = []
    for field in attrs.fields(cls):
        if field.metadata.get("internal"):
            continue
        help_text = field.metadata.get("help")
        if not isinstance(help_text, str) or not help_text.strip():
            missing.append(prefix + field.name)
        if attrs.has(field.type):
            missing += undocumented_options(field.type, f"{prefix}{field.name}.")
    return missing


def _selector_override(kind: str, name: str) -> str:
    if kind == "logger":  # a list: the component joins the recipe's jsonl logger
        return f"logger.loggers=[{', '.join(dict.fromkeys(['jsonl', name]))}]"
    return f"{SELECTORS[kind]}={name}"


def _section(cfg: MasterConfig, kind: str) -> Any:
    node = cfg
    for part in SELECTORS[kind].split(".")[:-1]:
        node = getattr(node, part)
    return node


def check_config(kind: str, name: str, overrides: Iterable[str] = (), *,
                 registry: Registry | None = None) -> Any:
    """The component's config block structured from its defaults; None when it takes no options.

    The config class must be an attrs class whose every option has help text (``option(default,
    help)``: ``grpoctl config schema`` prints it), and structure from ``{}`` through the real
    config loader with the component selected (strict keys and types, validators, the
    cross-field checks of the run config) on the built-in recipe plus ``overrides``. The resolved
    config is dumped to YAML and loaded back, as ``config.resolved.yaml`` of every run is: every
    default must survive the round trip.
    """
    import yaml

    from grpo_sdk.config.schema import plugin_config
    from grpo_sdk.config.loading import Structurer, load_config, to_yaml

    label = _label(kind, name)
    registry = registry or Registry.discover()
    spec = check_spec(kind, name, registry=registry)
    try:
        config_cls = registry.load_config_class(kind, name)
    except GrpoSdkError as exc:
        raise ContractError(str(exc)) from None
    if config_cls is not None:
        if not attrs.has(config_cls):
            raise ContractError(f"the config class {spec.config} of {label} is not an attrs class: declare it with "
                        "@attrs.frozen(kw_only=True) and option(default, help) fields, so the config loader "
                        "can check its keys and types")
        missing = undocumented_options(config_cls)
        if missing:
            raise ContractError(f"options of {label} without help text: {', '.join(missing)} ({spec.config}). Declare each "
                        "with option(default, \"what it does\"): `grpoctl config schema` and `grpoctl plugins show` "
                        "print it")
    try:
        cfg = load_config(None, [_selector_override(kind, name), *overrides], registry)
    except GrpoSdkError as exc:
        raise ContractError(f"the default config of {label} does not load:\n{exc}") from None
    block = plugin_config(_section(cfg, kind), name)
    if config_cls is not None and not isinstance(block, config_cls):
        raise ContractError(f"the config block of {label} structured into {type(block).__name__}, not {config_cls.__name__}")
    try:
        text = to_yaml(cfg)
        sections = {s.name: s.config for s in registry.host.config_sections()}
        again = plugin_config(_section(Structurer(registry, sections).structure(yaml.safe_load(text)), kind), name)
    except (GrpoSdkError, yaml.YAMLError) as exc:
        raise ContractError(f"the defaults of {label} do not survive a round trip through the resolved config YAML "
                    f"(config.resolved.yaml of every run): {exc}") from None
    if again != block:
        raise ContractError(f"the defaults of {label} change in a round trip through YAML: {block!r} became {again!r}; "
                    "use option types YAML can hold (str, int, float, bool, lists, mappings, None)")
    return block


# --- protocol -------------------------------------------------------------------------------------


def _bare(signature: inspect.Signature) -> str:
    """A signature without annotations, for messages: ``(prompts, sampling)``."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _method_signature(cls: type, attr: str) -> inspect.Signature:
    """The signature as callers of an instance see it (without ``self``)."""
    static = inspect.getattr_static(cls, attr)
    signature = inspect.signature(getattr(cls, attr))
    if isinstance(static, (staticmethod, classmethod)):
        return signature
    params = list(signature.parameters.values())[1:]
    return signature.replace(parameters=params)


def signature_problem(required: inspect.Signature, actual: inspect.Signature) -> str | None:
    """Why a method with signature ``actual`` cannot be called the way ``required`` is, or None.

    Positional parameters must be accepted positionally (names may differ), keyword-only ones
    by name, ``*args``/``**kwargs`` of the protocol need the same, and the method may add only
    parameters with defaults.
    """
    P = inspect.Parameter
    req = list(required.parameters.values())
    act = list(actual.parameters.values())
    act_positional = [p for p in act if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    act_names = {p.name: p for p in act if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    var_args = any(p.kind is P.VAR_POSITIONAL for p in act)
    var_kwargs = any(p.kind is P.VAR_KEYWORD for p in act)
    req_positional = [p for p in req if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    if len(req_positional) > len(act_positional) and not var_args:
        missing = [p.name for p in req_positional[len(act_positional):]]
        return f"it takes {len(act_positional)} positional arguments, the loop passes {len(req_positional)} " \
               f"(missing: {', '.join(missing)})"
    for p in req:
        if p.kind is P.KEYWORD_ONLY and p.name not in act_names and not var_kwargs:
            return f"it does not accept the keyword argument {p.name}="
        if p.kind is P.VAR_POSITIONAL and not var_args:
            return "it does not accept *args"
        if p.kind is P.VAR_KEYWORD and not var_kwargs:
            return f"it does not accept **{p.name} (the loop passes extra keyword arguments; take **kwargs)"
    req_names = {p.name for p in req if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    for i, p in enumerate(act_positional):
        if i >= len(req_positional) and p.default is P.empty and p.name not in req_names:
            return f"it requires the argument {p.name}, which the loop never passes (give it a default)"
    for p in act:
        if p.kind is P.KEYWORD_ONLY and p.default is P.empty and p.name not in req_names:
            return f"it requires the keyword argument {p.name}=, which the loop never passes (give it a default)"
    return None


CAPABILITY_PROTOCOLS: dict[str, type] = {
    "generates_prompts": protocols.PromptSampler,
    "in_flight_weight_updates": protocols.PausesForRefit,
    "receives_broadcast": protocols.ReceivesBroadcast,
    "runs_agents": RunsAgents,
    "tool_calls": DeclaresTools,
}
"""A declared capability -> the optional protocol whose methods it promises (``check_protocol``)."""


def _methods_of(protocol: type) -> dict[str, inspect.Signature]:
    """A protocol's methods and their signatures as callers of an instance see them (without self)."""
    out = {}
    for attr, fn in vars(protocol).items():
        if inspect.isfunction(fn) and not attr.startswith("_"):
            signature = inspect.signature(fn)
            out[attr] = signature.replace(parameters=list(signature.parameters.values())[1:])
    return out


def check_protocol(kind: str, name: str, *, registry: Registry | None = None) -> type:
    """The implementation class, checked against its kind's protocol without constructing it.

    The protocols are ``runtime_checkable``, but ``isinstance`` needs an instance (which needs a
    model and a run) and only checks that the names exist. This checks the class instead: it is
    constructed as ``Impl(config, context)``, has every method of the protocol, each callable
    the way the training loop calls it (``inspect`` signatures; positional names may differ), and
    not ``async``. A declared capability adds the methods it promises (``CAPABILITY_PROTOCOLS``): an
    environment declaring ``generates_prompts`` must have ``sample_prompts(num_prompts, rng)``, a
    generation backend declaring ``in_flight_weight_updates`` ``pause_generation(*, keep_in_flight)``
    and ``resume_generation(*, recompute_kv_cache)``. Every problem is reported at once.
    """
    label = _label(kind, name)
    registry = registry or Registry.discover()
    spec = check_spec(kind, name, registry=registry)
    try:
        impl = registry.load_impl(kind, name)
    except GrpoSdkError as exc:
        raise ContractError(str(exc)) from None
    if not inspect.isclass(impl):
        raise ContractError(f"{spec.impl} is a {type(impl).__name__}, not a class: the spec's impl must name the class "
                    "the loop constructs as Impl(config, context)")
    protocol = PROTOCOLS[kind]
    required = _methods_of(protocol)
    where = dict.fromkeys(required, f"the {protocol.__name__} protocol")
    for capability, promised in CAPABILITY_PROTOCOLS.items():
        if capability in spec.capabilities:
            methods = _methods_of(promised)
            required.update(methods)
            where.update(dict.fromkeys(methods, f"the {capability} capability: the {promised.__name__} protocol"))
    problems = []
    try:
        init = inspect.signature(impl)
    except (TypeError, ValueError):
        init = None
    if init is not None:
        P = inspect.Parameter
        why = signature_problem(inspect.Signature([P("config", P.POSITIONAL_OR_KEYWORD),
                                                   P("context", P.POSITIONAL_OR_KEYWORD)]), init)
        if why:
            problems.append(f"{impl.__name__}{_bare(init)} cannot be constructed as {impl.__name__}(config, context): "
                            f"{why}")
    api1 = impl.__dict__.get("api1_estimator")  # an estimator written for plugin API 1, adapted by the registry
    for attr, signature in required.items():
        if not callable(getattr(impl, attr, None)):
            problems.append(f"{impl.__name__} has no method {attr}{_bare(signature)} ({where[attr]})")
            continue
        owner = impl
        if attr == "compute_advantages" and api1 is not None:  # checked as written, against API 1's call
            owner, signature = api1, API1_CALL
            where[attr] = f"plugin API 1's {protocol.__name__} (adapted, deprecated)"
        actual = _method_signature(owner, attr)
        why = signature_problem(signature, actual)
        if why:
            problems.append(f"{impl.__name__}.{attr}{_bare(actual)} does not fit {attr}{_bare(signature)} of "
                            f"{where[attr]}: {why}")
        elif inspect.iscoroutinefunction(getattr(owner, attr)):
            problems.append(f"{impl.__name__}.{attr} is async; the training loop calls it synchronously")
    if problems:
        raise ContractError(f"{label} ({spec.impl}) does not satisfy the {protocol.__name__} protocol:\n"
                    + "\n".join(f"  - {p}" for p in problems))
    return impl
