"""`grpoctl plugins list|show`: every discovered component and hook plugin, with its status."""

from __future__ import annotations

import json
from typing import Optional

import attrs
import typer

from grpo_sdk.cli.common import EPILOG, fail, guarded, load_plugin_modules
from grpo_sdk.cli.config_cmd import PLUGIN_MODULES, default_text, type_name
from grpo_sdk.core.errors import ExitCode
from grpo_sdk.plugins.specs import KINDS

app = typer.Typer(help="List and inspect plugins: backends, estimators, environments, transports, loggers, hooks.",
                  no_args_is_help=True, epilog=EPILOG)


@app.command("list")
def list_(kind: Optional[str] = typer.Option(None, "--kind", help=f"One of: {', '.join(KINDS)}."),
          as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
          plugin_modules: Optional[list[str]] = PLUGIN_MODULES) -> None:
    """Every component with its status (ok, missing-requirements, broken, incompatible-api, conflict)."""
    def body() -> None:
        if kind is not None and kind not in KINDS:
            fail(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}", ExitCode.USAGE)
        registry = load_plugin_modules(plugin_modules or [])
        rows = registry.list(kind)
        if as_json:
            print(json.dumps({"components": [r.to_json() for r in rows],
                              "hooks": [h.to_json() for h in registry.hook_plugins]}, indent=2))
            return
        width = max([len(r.name) for r in rows] + [4])
        for r in rows:
            origin = f"{r.dist} {r.version}" if r.version else (r.dist or "?")
            text = r.spec.summary if r.ok and r.spec else f"{r.problem}" + (f"  -> {r.hint}" if r.hint else "")
            print(f"{r.kind:<12} {r.name:<{width}}  {r.status:<20} {origin:<22} {text}")
        for h in registry.hook_plugins:
            origin = f"{h.dist} {h.version}" if h.version else (h.dist or h.module or "?")
            text = ", ".join(h.hooks) if h.status == "ok" else h.problem
            print(f"{'hooks':<12} {h.name:<{width}}  {h.status:<20} {origin:<22} {text}")

    guarded(body)


@app.command()
def show(name: str = typer.Argument(..., help="Component name, e.g. hf."),
         kind: Optional[str] = typer.Option(None, "--kind", help="Needed when several kinds share the name."),
         as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
         plugin_modules: Optional[list[str]] = PLUGIN_MODULES) -> None:
    """One component: where it comes from, its status, requirements, capabilities and config keys."""
    def body() -> None:
        registry = load_plugin_modules(plugin_modules or [])
        matches = [r for r in registry.list(kind) if r.name == name]
        if not matches:
            fail(f"no component named {name!r}" + (f" of kind {kind}" if kind else ""), ExitCode.PLUGIN)
        out = []
        for info in matches:
            record = info.to_json()
            record["config_fields"] = []
            if info.ok and info.spec and info.spec.config:
                config_cls = registry.load_config_class(info.kind, info.name)
                attrs.resolve_types(config_cls)
                record["config_fields"] = [
                    {"name": f.name, "type": type_name(f.type), "default": default_text(f),
                     "help": f.metadata.get("help", "")}
                    for f in attrs.fields(config_cls)]
            out.append(record)
        if as_json:
            print(json.dumps(out if len(out) > 1 else out[0], indent=2))
            return
        for record in out:
            for key in ("kind", "name", "status", "dist", "version", "summary", "impl", "config", "requires",
                        "extra", "api", "capabilities", "problem", "hint"):
                if record.get(key) not in (None, [], ""):
                    print(f"{key:>13}: {record[key]}")
            for f in record["config_fields"]:
                print(f"{'option':>13}: {f['name']} ({f['type']}, default {f['default']}): {f['help']}")
            print()

    guarded(body)


from grpo_sdk.cli.plugins_new import new  # noqa: E402  (its own module: the scaffold is long)

app.command("new", epilog=EPILOG)(new)
