"""The contract kit: checks a plugin package runs to prove its component fits grpo-sdk.

Four checks, each raising an ``AssertionError`` that says what is wrong and how to fix it:

* ``check_spec(kind, name)``: the component is discovered through its entry point, its status
  is ok, and the entry-point name is the spec's name; ``check_light`` adds that importing the
  spec and config modules imports no torch (``grpoctl plugins list`` imports them all);
* ``check_config(kind, name)``: its config class is an attrs class whose every option has help
  text, and it structures from ``{}`` through the real config loader with the component selected
  (strict keys and types, the cross-field checks), and back from its resolved YAML;
* ``check_protocol(kind, name)``: the implementation class is constructed as
  ``Impl(config, context)`` and has every method of its kind's protocol, with signatures the
  training loop can call;
* ``run_training(kind, name)``: a short CPU run of the built-in recipe (tiny GPT-2, reverse
  digits, 4 prompts x 4 generations) through the real ``GRPOTrainer`` with the component
  selected; every metric of every step must be finite, and the generation backend must sample
  with the weights of the last sync. Then the weight-sync probe: optimizer steps with a fixed
  advantage move the policy's weights for certain (a run's own first steps may not
  move them: rewards all 0 give advantages all 0), one more sync, and the generation backend's
  logprobs of what it samples must match the policy's (``token_mult_prob_error`` close to 1).
  A backend whose ``update_weights`` ignores the weights fails here.

In a plugin package's tests they run as pytest tests: ``tests/conftest.py`` loads the kit as
a pytest plugin (opt-in, like ``tox.pytest``)::

    pytest_plugins = ["grpo_sdk.testing"]

``pyproject.toml`` names the components to check, ``"kind:name"`` plus optional config
overrides for the training run::

    [tool.pytest.ini_options]
    grpo_components = ["generation:acme"]

and a test module subclasses ``ContractTests``::

    from grpo_sdk.testing import ContractTests

    class TestContract(ContractTests):
        pass

Overrides known only when the tests run (the port of a server a fixture started) come from the
``grpo_overrides`` fixture: override it in the class or in ``conftest.py``::

    class TestContract(ContractTests):
        @pytest.fixture
        def grpo_overrides(self, acme_server):
            return [f"policy.generation.acme.url={acme_server.url}"]

Every helper takes ``registry=``: by default components are discovered from the installed
entry points (``Registry.discover()``), as ``grpoctl`` does; pass a registry to check components
registered in-process through the ``grpo_components`` hook.

Importing this module does not import torch; the pytest plugin needs pytest.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs

from grpo_sdk.core import protocols
from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.core.agents import RunsAgents
from grpo_sdk.core.multi_turn import DeclaresTools
from grpo_sdk.core.kinds import COMPONENT_KINDS
from grpo_sdk.plugins.registry import KIND_LABELS, Registry
from grpo_sdk.plugins.specs import KINDS, ComponentSpec

__all__ = [
    "SELECTORS",
    "Component",
    "ContractError",
    "ContractTests",
    "check_config",
    "check_light",
    "check_protocol",
    "check_spec",
    "parse_component",
    "run_training",
]

SELECTORS: dict[str, str] = {kind.name: kind.selector_key for kind in COMPONENT_KINDS}
"""Component kind -> the config key that selects it (``logger.loggers`` is a list)."""

PROTOCOLS: dict[str, type] = {kind.name: kind.protocol for kind in COMPONENT_KINDS}
"""Component kind -> the protocol its implementation must satisfy."""

# The run ``run_training`` makes: the built-in recipe, small, on the CPU, with nothing but training.
SMALL_RUN = (
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "checkpointing.enabled=false",
    "cluster.runtime=local",
    "cluster.device=cpu",
)

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


def _section(cfg: Any, kind: str) -> Any:
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
    for attr, signature in required.items():
        if not callable(getattr(impl, attr, None)):
            problems.append(f"{impl.__name__} has no method {attr}{_bare(signature)} ({where[attr]})")
            continue
        actual = _method_signature(impl, attr)
        why = signature_problem(signature, actual)
        if why:
            problems.append(f"{impl.__name__}.{attr}{_bare(actual)} does not fit {attr}{_bare(signature)} of "
                            f"{where[attr]}: {why}")
        elif inspect.iscoroutinefunction(getattr(impl, attr)):
            problems.append(f"{impl.__name__}.{attr} is async; the training loop calls it synchronously")
    if problems:
        raise ContractError(f"{label} ({spec.impl}) does not satisfy the {protocol.__name__} protocol:\n"
                    + "\n".join(f"  - {p}" for p in problems))
    return impl


# --- training -------------------------------------------------------------------------------------

# What a step may leave non-finite: the min or max over an empty set.
_EXTREMES = ("_min", "_max")

# The weight-sync probe: how far it moves the policy (in token_mult_prob_error, as a multiple of
# the logprob tolerance, so a stale backend is well outside it) and how many optimizer steps it
# may take to get there.
PROBE_MARGIN = 3.0
PROBE_MAX_STEPS = 32


def run_training(kind: str, name: str, overrides: Sequence[str] = (), *, steps: int = 2,
                 registry: Registry | None = None, run_dir: str | Path | None = None,
                 model_dir: str | Path | None = None, logprob_tolerance: float | None = 0.01
                 ) -> list[dict[str, float]]:
    """Train ``steps`` steps of the built-in recipe through the real ``GRPOTrainer`` with the
    component selected, then probe the weight sync; returns each step's metrics (with ``"step"``).

    The run: tiny GPT-2 (``model_dir``, or built into the run directory), reverse digits, 4
    prompts x 4 generations, no validation, no checkpoints, on the CPU; then ``overrides``. A
    logger joins the recipe's ``jsonl`` logger. Fails when setup or a step raises, when the
    component was not the one the run used, when a metric is not finite, or when generation did
    not sample with the last synced weights: from step 2 on, ``generation/weight_version`` must
    be the previous step and ``token_mult_prob_error`` within ``logprob_tolerance`` of 1 (None
    skips this and the probe; a bf16 inference engine may need more than the default 0.01).

    The probe does not trust the run to have changed the weights (when every step-1 reward is 0,
    every advantage is 0 and no weight moves, so a backend that ignores ``update_weights`` would
    still agree with the policy). It samples the next prompts, trains the policy on them with
    advantage -1 on every generated token until its logprobs of those tokens have moved by
    ``PROBE_MARGIN`` x ``logprob_tolerance`` (in token_mult_prob_error), syncs the weights through
    the run's transport as version ``steps + 1``, samples again, and requires the generation
    backend to report that version and logprobs within ``logprob_tolerance`` of the policy's.
    """
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer

    label = _label(kind, name)
    registry = registry or Registry.discover()
    check_spec(kind, name, registry=registry)
    model = [f"policy.model_name={model_dir}"] if model_dir is not None else []
    try:
        cfg = load_config(None, [*SMALL_RUN, f"grpo.max_num_steps={steps}", *model, _selector_override(kind, name),
                                 *overrides], registry)
    except GrpoSdkError as exc:
        raise ContractError(f"the training config for {label} does not load:\n{exc}") from None

    with tempfile.TemporaryDirectory(prefix="grpo-contract-") as scratch:
        trainer = GRPOTrainer(cfg, run_dir=Path(run_dir) if run_dir is not None else Path(scratch) / "run",
                              registry=registry)
        rows: list[dict[str, float]] = []
        phase = "setup"
        try:
            trainer.setup()
            _check_built(trainer, kind, name, registry)
            phase = "training"
            trainer.train(on_step=lambda step, metrics: rows.append({"step": step, **metrics}))
            _check_metrics(rows, label, steps, logprob_tolerance)
            if logprob_tolerance is not None:
                phase = "the weight-sync probe"
                _probe_weight_sync(trainer, label, steps + 1, logprob_tolerance)
        except ContractError:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever the component raised is the finding
            if isinstance(exc, KeyboardInterrupt):
                raise
            where = {"setup": "in setup", "training": f"in step {len(rows) + 1}"}.get(phase, f"in {phase}")
            raise ContractError(f"training with {label} failed {where}: {type(exc).__name__}: {exc}") from exc
        finally:
            trainer.shutdown()
    return rows


def _check_built(trainer: Any, kind: str, name: str, registry: Registry) -> None:
    """The run built the component under test (seen through the local runtime's deadline wrapper)."""
    impl = registry.load_impl(kind, name)
    parts = trainer.components
    built = parts.loggers if kind == "logger" else [getattr(parts, kind)]  # the record names them by kind
    from grpo_sdk.runtime.deadlines import EnvironmentDeadline

    built = [obj.component if isinstance(obj, EnvironmentDeadline) else obj for obj in built]
    if inspect.isclass(impl) and not any(isinstance(obj, impl) for obj in built):
        raise ContractError(f"the run did not use {_label(kind, name)}: it built {[type(o).__name__ for o in built]}; "
                    f"do the overrides select another {KIND_LABELS[kind]}?")
    protocol = PROTOCOLS[kind]
    for obj in built:
        if isinstance(obj, impl) and not isinstance(obj, protocol):
            raise ContractError(f"the {type(obj).__name__} instance is not a {protocol.__name__} (isinstance check)")


def _check_metrics(rows: list[dict[str, float]], label: str, steps: int, tolerance: float | None) -> None:
    if len(rows) != steps:
        raise ContractError(f"training with {label} logged {len(rows)} steps, expected {steps}")
    for row in rows:
        bad = {k: v for k, v in row.items()
               if not k.endswith(_EXTREMES) and isinstance(v, (int, float)) and not math.isfinite(v)}
        if bad:
            listed = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
            raise ContractError(f"training with {label}: non-finite metrics in step {row['step']}: {listed}")
    for row in rows[1:]:
        step = row["step"]
        version = row.get("generation/weight_version")
        if version is not None and version != step - 1:
            raise ContractError(f"training with {label}: step {step} sampled with weight version {version:g}, but version "
                        f"{step - 1} was synced after step {step - 1}. A generation backend reports the version of "
                        "its last update_weights(..., version=) in GenerationOutput.weight_version; a weight-sync "
                        "transport passes version= through")
        error = row.get("token_mult_prob_error")
        if tolerance is not None and error is not None and abs(error - 1.0) > tolerance:
            raise ContractError(f"training with {label}: token_mult_prob_error is {error:.4f} in step {step} (allowed: 1 "
                        f"+- {tolerance}): generation's logprobs disagree with the policy's for the sampled tokens. "
                        "Either generation does not report the logprob of each token under the distribution it was "
                        "sampled from (temperature, top-k, top-p applied), or it did not sample with the weights of "
                        "the last sync (update_weights / sync_weights)")


def _mult_prob_error(a: Any, b: Any, mask: Any) -> float:
    """Mean of exp(|a - b|) over ``mask`` (the loss's token_mult_prob_error)."""
    mask = mask.float().cpu()
    diff = (a.float().cpu() - b.float().cpu()).abs().exp()
    return float((diff * mask).sum() / mask.sum().clamp(min=1))


def _probe_weight_sync(trainer: Any, label: str, version: int, tolerance: float) -> dict[str, float]:
    """Move the policy for certain, sync, and check generation samples under the new weights (see
    ``run_training``). Talks to the built components through their protocols only; takes the run's
    prompt source, tokenizer and sampling parameters from ``trainer.components``."""
    import torch

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.config.schema import LossConfig
    from grpo_sdk.core.records import GenerationInput, TrainBatch
    from grpo_sdk.trainer.rollout import left_pad, tokenize_prompts

    cfg, parts = trainer.config, trainer.components
    policy, generation, G = parts.policy, parts.generation, cfg.grpo.num_generations_per_prompt
    prompts = parts.prompts.next_prompts(cfg.grpo.num_prompts_per_step)
    rows = [ids for ids in tokenize_prompts(parts.tokenizer, prompts, parts.max_prompt_tokens) for _ in range(G)]
    input_ids, attention_mask = left_pad(rows, parts.tokenizer.pad_token_id)
    inputs = GenerationInput(input_ids=input_ids, attention_mask=attention_mask)

    def sample() -> tuple[int, TrainBatch]:
        generation.prepare_for_generation()
        try:
            out = generation.generate(inputs, parts.sampling)
        finally:
            generation.finish_generation()
        width = out.response_ids.shape[1]
        response_mask = (torch.arange(width)[None] < out.response_lengths.cpu()[:, None]).long()
        token_mask = torch.cat([torch.zeros_like(input_ids), response_mask], 1).float()
        return out.weight_version, TrainBatch(
            input_ids=torch.cat([input_ids, out.response_ids.cpu()], 1),
            attention_mask=torch.cat([attention_mask, response_mask], 1), token_mask=token_mask,
            sample_mask=torch.ones(len(rows)),
            generation_logprobs=torch.cat([torch.zeros(input_ids.shape), out.logprobs.float().cpu()], 1),
            group_ids=torch.arange(len(prompts)).repeat_interleave(G), rewards=torch.zeros(len(rows)),
            advantages=-token_mask)  # -1 on every generated token: the policy makes them less likely

    # 1. Move the policy: a fixed advantage gives a gradient whatever the rewards were. Negative, so
    # the sampled tokens lose probability: at a low temperature they are near certain, and making
    # them more likely would not move their logprobs.
    _, batch = sample()
    before = policy.logprobs(batch)
    loss_fn = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0))
    floor = 1.0 + PROBE_MARGIN * tolerance
    moved, nudges = 1.0, 0
    while moved < floor and nudges < PROBE_MAX_STEPS:
        policy.train(batch, loss_fn)
        nudges += 1
        moved = _mult_prob_error(policy.logprobs(batch), before, batch.token_mask)
    if moved < floor:
        optimizer = cfg.policy.optimizer
        raise ContractError(
            f"training with {label}: the weight-sync probe trained the policy {nudges} times with advantage -1 on "
            f"every sampled token and its logprobs of those tokens moved by only {moved:.4f} (token_mult_prob_error "
            f"against the logprobs before; needed: {floor:.4f}). "
            + ("policy.train changes no weight: it must take an optimizer step on the loss it is given"
               if moved == 1.0 else
               f"Raise policy.optimizer.lr (now {optimizer.lr:g}) in the component's overrides, or check "
               "policy.scheduler (the probe trains after the run's last step)"))

    # 2. Sync through the run's transport; generation must now sample with the moved weights.
    parts.weight_sync.sync_weights(policy, generation, version=version)
    reported, batch = sample()
    if reported != version:
        raise ContractError(f"training with {label}: after the weight sync of version {version}, generation reported "
                            f"weight version {reported} (GenerationOutput.weight_version must be the version= of its "
                            "last update_weights)")
    error = _mult_prob_error(batch.generation_logprobs, policy.logprobs(batch), batch.token_mask)
    if abs(error - 1.0) > tolerance:
        raise ContractError(
            f"training with {label}: generation does not sample with the synced weights. The probe moved the policy "
            f"(its logprobs of sampled tokens changed by {moved:.4f} in token_mult_prob_error), synced version "
            f"{version}, and generation, though it reports version {reported}, gives the tokens it samples logprobs "
            f"that disagree with the policy's: token_mult_prob_error {error:.4f} (allowed: 1 +- {tolerance}). "
            "update_weights(weights, version=) must load every (name, tensor) it is given before it returns; a "
            "backend that talks to a server must have the server load them (docs/plugins.md, out-of-process "
            "backends)")
    return {"probe/policy_moved": moved, "probe/optimizer_steps": float(nudges),
            "generation/weight_version": float(reported), "token_mult_prob_error": error}


# --- the pytest suite -----------------------------------------------------------------------------


class ContractTests:
    """grpo-sdk's contract as pytest tests, once per component in the ``grpo_components`` ini option.

    Subclass it in a test module (the subclass's name must start with ``Test``)::

        from grpo_sdk.testing import ContractTests

        class TestContract(ContractTests):
            steps = 3                  # training steps of test_trains
            logprob_tolerance = 0.05   # e.g. a bf16 inference engine; None skips the check

    Needs ``pytest_plugins = ["grpo_sdk.testing"]`` in ``conftest.py`` (the ``grpo_component``,
    ``grpo_overrides`` and ``grpo_tiny_model`` fixtures). Config overrides known only when the
    tests run (a server's port) come from the ``grpo_overrides`` fixture; override it::

        class TestContract(ContractTests):
            @pytest.fixture
            def grpo_overrides(self, acme_server):   # a fixture of the plugin's own conftest.py
                return [f"policy.generation.acme.url={acme_server.url}"]

    They follow the component's own overrides (``grpo_components``) in ``test_config`` and
    ``test_trains``. Override a test to skip or extend it.
    """

    steps: int = 2
    logprob_tolerance: float | None = 0.01

    def test_spec(self, grpo_component: Component) -> None:
        check_spec(grpo_component.kind, grpo_component.name)

    def test_spec_is_light(self, grpo_component: Component) -> None:
        check_light(grpo_component.kind, grpo_component.name)

    def test_config(self, grpo_component: Component, grpo_overrides: Sequence[str]) -> None:
        check_config(grpo_component.kind, grpo_component.name, [*grpo_component.overrides, *grpo_overrides])

    def test_protocol(self, grpo_component: Component) -> None:
        check_protocol(grpo_component.kind, grpo_component.name)

    def test_trains(self, grpo_component: Component, grpo_overrides: Sequence[str], grpo_tiny_model: Path,
                    tmp_path: Path) -> None:
        run_training(grpo_component.kind, grpo_component.name, [*grpo_component.overrides, *grpo_overrides],
                     steps=self.steps, run_dir=tmp_path / "run", model_dir=grpo_tiny_model,
                     logprob_tolerance=self.logprob_tolerance)


# The pytest plugin: `pytest_plugins = ["grpo_sdk.testing"]` registers this module, so its hooks
# and fixtures must be names here. Imported last because it uses the helpers above; without
# pytest the check_* helpers still work (e.g. in a release script).
try:
    from grpo_sdk.testing.pytest_plugin import (  # noqa: E402
        grpo_component,
        grpo_overrides,
        grpo_tiny_model,
        pytest_addoption,
        pytest_generate_tests,
    )
except ModuleNotFoundError as exc:
    if exc.name != "pytest":
        raise
else:
    __all__ += ["grpo_component", "grpo_overrides", "grpo_tiny_model", "pytest_addoption", "pytest_generate_tests"]
