"""`grpoctl config show|validate|schema`: the resolved config, its check, and its documentation."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any, Optional

import attrs
import typer

from grpo_sdk.cli.common import EPILOG, get_registry, guarded, load_plugin_modules
from grpo_sdk.config import schema as C

app = typer.Typer(help="Show, validate and document run configs.", no_args_is_help=True, epilog=EPILOG)

OVERRIDES = typer.Argument(None, help="Dotted overrides, as for `grpoctl run`.")
FILES = typer.Option(None, "-c", "--config", help="Config YAML; repeat to layer files. Default: the built-in recipe.")
PLUGIN_MODULES = typer.Option(None, "-p", "--plugin", help="Import MODULE as a hook plugin first, as `grpoctl run -p` "
                              "does: the components and config sections it registers count.")


def _load(files: Optional[list[Path]], overrides: Optional[list[str]],
          plugin_modules: Optional[list[str]]) -> C.MasterConfig:
    from grpo_sdk.config.loading import load_config

    return load_config([str(f) for f in files or []], overrides or [], load_plugin_modules(plugin_modules or []))


@app.command()
def show(overrides: Optional[list[str]] = OVERRIDES, config: Optional[list[Path]] = FILES,
         format: str = typer.Option("yaml", "--format", help="yaml or json."),
         plugin_modules: Optional[list[str]] = PLUGIN_MODULES) -> None:
    """Print the resolved config: defaults < files < overrides, selected plugin blocks in full."""
    if format not in ("yaml", "json"):
        raise typer.BadParameter(f"{format!r} is not one of 'yaml', 'json'", param_hint="--format")
    def body() -> None:
        from grpo_sdk.config.loading import dump_config, to_yaml

        cfg = _load(config, overrides, plugin_modules)
        print(json.dumps(dump_config(cfg), indent=2) if format == "json" else to_yaml(cfg), end="")

    guarded(body)


@app.command()
def validate(overrides: Optional[list[str]] = OVERRIDES, config: Optional[list[Path]] = FILES,
             plugin_modules: Optional[list[str]] = PLUGIN_MODULES) -> None:
    """Check a config without loading any model: unknown keys, types, ranges, cross-field rules, plugins,
    and what the run would fail on at start-up (data files, model sources, prompt lengths)."""
    def body() -> None:
        from grpo_sdk.cli.preflight import preflight
        from grpo_sdk.core.errors import ConfigError

        cfg = _load(config, overrides, plugin_modules)
        notes: list[str] = []
        problems = preflight(cfg, get_registry(), notes)
        if problems:
            raise ConfigError(problems)
        rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        print(f"config OK: policy {cfg.policy.backend} ({cfg.policy.model_name}), generation "
              f"{cfg.policy.generation.backend}, estimator {cfg.grpo.adv_estimator.name}, env {cfg.env.name}, "
              f"weight sync {cfg.weight_sync.backend}; {rows} rollouts per step, {cfg.grpo.max_num_steps} steps")
        for note in notes:
            print(f"  {note}")

    guarded(body)


@app.command()
def schema(section: Optional[str] = typer.Argument(None, help="Only keys under this dotted prefix, e.g. "
                                                   "`grpo` or `policy.generation.hf`."),
           plugin_modules: Optional[list[str]] = PLUGIN_MODULES) -> None:
    """Print every config key with its type, default and documentation, plugin blocks included."""
    def body() -> None:
        lines = []
        registry = load_plugin_modules(plugin_modules or [])
        for path, kind, default, help_text in schema_rows(C.MasterConfig, "", registry):
            if section and not (path == section or path.startswith((section + ".", section + "[]"))):
                continue
            lines.append(f"{path}: {kind} = {default}\n    {help_text}")
        if not lines:
            raise typer.BadParameter(f"no config key under {section!r}")
        print("\n".join(lines))

    guarded(body)


def type_name(type_: Any) -> str:
    if isinstance(type_, type):
        return type_.__name__
    return str(type_).replace("typing.", "")


def default_text(field: attrs.Attribute) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "(required)"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()
        if attrs.has(type(default)):
            return "{...}"
    return json.dumps(default) if not isinstance(default, tuple) else json.dumps(list(default))


def schema_rows(cls: type, prefix: str, registry: Any) -> list[tuple[str, str, str, str]]:
    """(path, type, default, help) for every user-facing key below ``cls``, recursively."""
    attrs.resolve_types(cls)
    rows = []
    for field in attrs.fields(cls):
        if field.metadata.get("internal"):
            continue
        path = f"{prefix}{field.name}"
        item_type = typing.get_args(field.type)[0] if typing.get_origin(field.type) is list else None
        if attrs.has(field.type):
            rows.append((path, "section", "", field.metadata.get("help", "")))
            rows.extend(schema_rows(field.type, path + ".", registry))
        elif item_type is not None and attrs.has(item_type):
            rows.append((path, f"list of {item_type.__name__}", default_text(field), field.metadata.get("help", "")))
            rows.extend(schema_rows(item_type, path + "[].", registry))
        else:
            rows.append((path, type_name(field.type), default_text(field), field.metadata.get("help", "")))
    slot = getattr(cls, "__plugin__", None)
    if slot is not None:
        for info in registry.list(slot.kind):
            block = f"{prefix}{info.name}"
            if info.status != "ok" or info.spec is None or info.spec.config is None:
                note = f"({info.status}: {info.problem})" if info.status != "ok" else "(no options)"
                rows.append((block, "plugin block", "", f"{info.spec.summary if info.spec else ''} {note}".strip()))
                continue
            config_cls = registry.load_config_class(slot.kind, info.name)
            rows.append((block, "plugin block", "", info.spec.summary))
            rows.extend(schema_rows(config_cls, block + ".", registry))
    return rows

