"""Generate the reference pages of the documentation site from the code.

* ``reference/config.md``: every config key with its type, default and help text, from the
  ``metadata["help"]`` of the attrs fields in ``grpo_sdk.config.schema`` and of the built-in
  plugins' config classes (the rows ``grpoctl config schema`` prints, grouped by section).
* ``reference/cli.md``: the ``--help`` of every ``grpoctl`` command, from the Typer app.

``docs/hooks.py`` calls :func:`generate` while ``mkdocs build`` runs, so the pages are never
stale and never committed. To look at the Markdown itself::

    python docs/gen_reference.py /tmp/reference     # writes config.md and cli.md there

Nothing here imports torch: specs and config classes are light by design.
"""

from __future__ import annotations

import html
import importlib.metadata as md
import re
import sys
from pathlib import Path
from typing import Any

import attrs

DIST = "grpo-sdk"
WIDTH = 96  # help text width of the CLI reference


# --- the registry of grpo-sdk's own components -------------------------------------------------


def builtin_registry() -> Any:
    """A registry of the components grpo-sdk itself registers, whatever else is installed.

    A built-in whose requirements are not installed here (vllm) is still documented: its status
    is set to ok for the schema walk, since its spec and config class are light. Third-party
    plugins are left out: their blocks belong to their own docs (``grpoctl config schema`` shows
    them where they are installed).
    """
    from grpo_sdk.plugins.registry import Registry, _inspect_entry_point
    from grpo_sdk.plugins.specs import KINDS

    infos = []
    for kind, group in KINDS.items():
        for ep in md.entry_points(group=group):
            dist = getattr(ep, "dist", None)
            if dist is None or _canonical(dist.name) != DIST:
                continue
            info = _inspect_entry_point(kind, ep)
            if info.status == "missing-requirements":
                info = attrs.evolve(info, status="ok", problem=None, hint=None)
            if info.status != "ok":
                raise RuntimeError(f"built-in {kind} {info.name!r} is {info.status}: {info.problem}")
            infos.append(info)
    if not infos:
        raise RuntimeError(f"no entry points of {DIST} found: install it (pip install -e .) before building the docs")
    from grpo_sdk.plugins.host import PluginHost

    return Registry(infos, PluginHost())


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- Markdown helpers -----------------------------------------------------------------------------


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def md_text(text: str) -> str:
    """Help text as Markdown: backtick spans stay code, everything else is literal text."""
    out = []
    for part in _CODE_SPAN.split(text):
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part)  # Python-Markdown's tables do not split cells inside code spans
        else:
            part = html.escape(part, quote=False)
            out.append(re.sub(r"([\\*_\[\]|#])", r"\\\1", part))
    return "".join(out)


def md_code(text: str) -> str:
    """``text`` as an inline code span (safe in a table cell: cells are not split inside code)."""
    if not text:
        return ""
    fence, pad = ("``", " ") if "`" in text else ("`", "")
    return fence + pad + text + pad + fence


def anchor(path: str) -> str:
    """The id of a section heading: its dotted path (``#grpo.reward_scaling``)."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", path)


# --- the config reference -------------------------------------------------------------------------


@attrs.define
class _Section:
    path: str
    kind: str  # "section", "plugin block" or "root"
    help: str
    rows: list[tuple[str, str, str, str]] = attrs.field(factory=list)


def _slot_of(section_path: str) -> Any:
    """The PluginSlot of the config section at ``section_path`` (``policy.generation``), or None."""
    from grpo_sdk.config import schema as C

    cls: Any = C.MasterConfig
    for part in section_path.split("."):
        attrs.resolve_types(cls)
        field = attrs.fields_dict(cls)[part]
        cls = field.type
    return getattr(cls, "__plugin__", None)


def config_rows(registry: Any) -> list[tuple[str, str, str, str]]:
    from grpo_sdk.cli.config_cmd import schema_rows
    from grpo_sdk.config.schema import MasterConfig

    return schema_rows(MasterConfig, "", registry)


def config_reference(registry: Any | None = None) -> str:
    registry = registry or builtin_registry()
    rows = config_rows(registry)
    sections: dict[str, _Section] = {"": _Section("", "root", "")}
    for path, kind, default, help_text in rows:
        parent = max((p for p in sections if p == "" or path.startswith((p + ".", p + "[]."))), key=len)
        if kind in ("section", "plugin block"):
            sections[path] = _Section(path, kind, help_text)
        else:
            sections[parent].rows.append((path, kind, default, help_text))

    out = [
        "# Config reference",
        "",
        "Every key of a run config: its type, its default and what it does. This page is generated",
        "from the field documentation in the code (`grpo_sdk.config.schema` and the config classes of the",
        "built-in plugins), the same text `grpoctl config schema [SECTION]` prints. A config is",
        "defaults < `-c` files < dotted overrides; see [Concepts](../concepts.md#configuration).",
        "",
        "A pluggable section names its plugin with a selector key (`policy.generation.backend`,",
        "`grpo.adv_estimator.name`, `env.name`, `weight_sync.backend`, `policy.backend`, `logger.loggers`)",
        "and keeps one block per plugin, keyed by the plugin's name; only the selected block is validated.",
        "The blocks of grpo-sdk's own plugins are listed under their section. Third-party plugins",
        "document their blocks themselves; `grpoctl config schema` lists every block installed where it runs.",
        "",
        "Types: `X | None` keys accept `null`. Defaults are JSON; `(required)` keys have no default.",
        "",
    ]
    for section in list(sections.values())[1:]:
        depth = section.path.count(".") + 1
        level = "#" * min(depth + 1, 6)
        title = f"`{section.path}`"
        out.append(f"{level} {title} {{#{anchor(section.path)}}}")
        out.append("")
        if section.kind == "plugin block":
            out.extend(_plugin_block_intro(section, registry))
        elif section.help:
            out.append(md_text(section.help))
            out.append("")
        if section.rows:
            out.append("| key | type | default | meaning |")
            out.append("|---|---|---|---|")
            for path, kind, default, help_text in section.rows:
                out.append(f"| {md_code(path)} | {md_code(kind)} | {md_code(default)} | {md_text(help_text)} |")
            out.append("")
        elif section.kind == "plugin block":
            out.append("No options.")
            out.append("")
    return "\n".join(out)


def _plugin_block_intro(section: _Section, registry: Any) -> list[str]:
    parent, _, name = section.path.rpartition(".")
    slot = _slot_of(parent)
    spec = registry.get(slot.kind, name)
    select = (f"listed in `{parent}.{slot.selector}`" if slot.many
              else f"selected by `{parent}.{slot.selector}: {name}`")
    text = f"The `{name}` {slot.kind.replace('_', '-')} plugin, {select}. {md_text(spec.summary)}"
    if spec.extra:
        needs = ", ".join(md_code(r) for r in spec.requires)
        text += f" Needs {needs}: `pip install 'grpo-sdk[{spec.extra}]'`."
    return [text, ""]


# --- the CLI reference -----------------------------------------------------------------------------


def cli_commands() -> list[tuple[str, str]]:
    """(command path, --help text) for ``grpoctl`` and every subcommand, depth first.

    Walks the Typer app's click command tree directly: commands that installed hook plugins add
    at run time (``grpo_cli_commands``) are not part of it.
    """
    import typer

    from grpo_sdk.cli.app import app

    root = typer.main.get_command(app)
    found: list[tuple[str, str]] = []

    # Typer >= 0.26 carries its own copy of click, so no isinstance checks against `click`.
    def walk(cmd: Any, name: str, parent: Any) -> None:
        ctx = cmd.context_class(cmd, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
        found.append((ctx.command_path, cmd.get_help(ctx)))
        if hasattr(cmd, "list_commands"):
            for sub in cmd.list_commands(ctx):
                child = cmd.get_command(ctx, sub)
                if child is not None and not child.hidden:
                    walk(child, sub, ctx)

    walk(root, "grpoctl", None)
    return found


def cli_reference() -> str:
    commands = cli_commands()
    out = [
        "# CLI reference",
        "",
        "The `--help` of every `grpoctl` command, generated from the Typer app when this site is built.",
        "Every command exits 0 ok, 1 run failed, 2 usage or config error, 3 plugin error, 4 doctor",
        "check failed, 130 interrupted. Installed hook plugins may add commands (the",
        "`grpo_cli_commands` hook, see [Writing a plugin](../plugins.md#hooks)); `grpoctl --help` lists",
        "them where they are installed.",
        "",
        "Commands: " + ", ".join(f"[`{path}`](#{anchor(path.replace(' ', '-'))})" for path, _ in commands[1:]) + ".",
        "",
    ]
    for path, text in commands:
        level = "#" * (2 + max(path.count(" ") - 1, 0))  # grpoctl, grpoctl run: h2; grpoctl config show: h3
        out += [f"{level} `{path}` {{#{anchor(path.replace(' ', '-'))}}}", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(out)


# --- entry points ------------------------------------------------------------------------------


def generate() -> dict[str, str]:
    """Site-relative path -> Markdown of every generated page."""
    return {"reference/config.md": config_reference(), "reference/cli.md": cli_reference()}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python docs/gen_reference.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    for rel, text in generate().items():
        target = out / Path(rel).name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n", encoding="utf-8")
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
