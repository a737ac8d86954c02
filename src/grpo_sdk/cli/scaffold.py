"""`grpoctl plugins new`: a plugin project for any component kind, ready to install and test.

The project is what docs/plugins.md describes, filled in: ``pyproject.toml`` with the entry
point, a light ``spec.py`` (the ``ComponentSpec`` and a documented config class), an
implementation that satisfies the kind's protocol and trains as is, and ``tests/`` running
grpo-sdk's contract kit (``grpo_sdk.testing``)::

    files = render(plugin_names("acme"), "estimator")   # {"pyproject.toml": "...", ...}
    write_project(Path("grpo-acme"), files)

The templates are package data, ``grpo_sdk/cli/templates/``: ``common/`` holds the files every
project shares, and one directory per template (``<kind>``, or ``<kind>-<variant>`` such as
``generation-server``) a ``template.toml`` (what the kind's spec and README need: its config
options, its protocol, how a run selects it, and the project's files in order) next to the
template files of its own. The texts are ``string.Template`` (``$package``, ``$Impl``, ...):
the files they render are Python, TOML and Markdown full of braces, and ``$`` appears in none
of them.
"""

from __future__ import annotations

import re
import tomllib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from string import Template

import attrs

from grpo_sdk.core.kinds import COMPONENT_KINDS
from grpo_sdk.plugins.registry import KIND_LABELS
from grpo_sdk.plugins.specs import KINDS, PLUGIN_API_VERSION

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_\-]*$")  # the ComponentSpec name rule
DEFAULT_TEMPLATE = "default"


@attrs.frozen
class PluginNames:
    """The names one plugin goes by, all derived from what the user typed."""

    name: str  # the component: what users write in config, e.g. "acme-gen"
    dist: str  # the distribution: "grpo-acme-gen"
    package: str  # the import package: "grpo_acme_gen"
    classes: str  # the class-name prefix: "AcmeGen"


def _separators(match: re.Match[str]) -> str:
    """A run of separators becomes one: ``_`` when it is only underscores, else ``-``."""
    return "_" if set(match.group()) == {"_"} else "-"


def plugin_names(text: str) -> PluginNames:
    """``"Acme Gen"`` or ``"grpo-acme-gen"`` -> component ``acme-gen``, ``grpo-acme-gen``, ``grpo_acme_gen``.

    Lower case; anything outside ``[a-z0-9_-]`` becomes ``-``, and a run of separators one
    (``"acme - gen"`` is ``acme-gen``, as its package ``grpo_acme_gen`` and class ``AcmeGen``
    say); a leading ``grpo-`` is dropped (the distribution gets it back). The distribution and
    package spell the component's separators as ``-`` and ``_``, as pip and Python need. Raises
    ValueError when nothing usable is left, or when the distribution would be grpo-sdk itself.
    """
    name = re.sub(r"[^a-z0-9_-]+", "-", text.strip().lower())
    name = re.sub(r"[-_]{2,}", _separators, name)
    name = re.sub(r"^grpo[-_]+", "", name).strip("-_")
    if not name or not _NAME_RE.match(name):
        raise ValueError(f"{text!r} is not a usable plugin name: use letters, digits, - and _, e.g. 'acme'")
    dist = "grpo-" + name.replace("_", "-")
    if dist == "grpo-sdk":
        raise ValueError(f"{text!r} would make the distribution grpo-sdk, which is grpo-sdk itself: pick another name")
    classes = "".join(part.capitalize() for part in re.split(r"[-_]+", name))
    if classes[0].isdigit():
        classes = "Grpo" + classes
    return PluginNames(name=name, dist=dist, package="grpo_" + name.replace("-", "_"), classes=classes)


def sdk_requirement() -> str:
    """``grpo-sdk>=X.Y,<X+1`` for the installed grpo-sdk: the plugin API is stable within a major."""
    from packaging.version import Version

    from grpo_sdk import __version__

    version = Version(__version__)
    return f"grpo-sdk>={version.major}.{version.minor},<{version.major + 1}"


# --- the templates (package data) ---------------------------------------------------------------


def template_root() -> Traversable:
    """``grpo_sdk/cli/templates``, wherever grpo-sdk is installed (a wheel, an editable checkout)."""
    return resources.files("grpo_sdk.cli") / "templates"


@attrs.frozen(kw_only=True)
class KindTemplate:
    """One ``templates/<dir>/template.toml``: what a kind's project needs besides the shared files."""

    kind: str
    module: str  # the implementation module, src/<package>/<module>.py
    suffix: str  # the implementation class is <Classes><suffix>
    protocol: str  # the protocol it satisfies (grpo_sdk.plugins)
    summary: str
    options: str  # the config class body
    usage: str  # a run config selecting it (YAML)
    files: dict[str, str]  # path in the project ($package) -> template file under templates/, in order
    dependencies: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    capabilities: str = ""  # a ComponentSpec line, e.g. 'capabilities={"generates_prompts"},'
    components: tuple[str, ...] = attrs.field(default=("$kind:$name",), converter=tuple)  # grpo_components


def template_dir(kind: str, template: str = DEFAULT_TEMPLATE) -> str:
    return kind if template == DEFAULT_TEMPLATE else f"{kind}-{template}"


def templates(kind: str) -> list[str]:
    """The templates ``plugins new --kind KIND --template ...`` offers, ``default`` first."""
    found = [entry.name.removeprefix(kind + "-") for entry in template_root().iterdir()
             if entry.is_dir() and entry.name.startswith(kind + "-")]
    return [DEFAULT_TEMPLATE, *sorted(found)]


def load_template(kind: str, template: str = DEFAULT_TEMPLATE) -> KindTemplate:
    """The template of ``kind`` (ValueError naming what exists when there is none)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    source = template_root() / template_dir(kind, template) / "template.toml"
    if not source.is_file():
        raise ValueError(f"no template {template!r} for --kind {kind}; templates: {', '.join(templates(kind))}")
    data = tomllib.loads(source.read_text(encoding="utf-8"))
    if data.get("kind") != kind:
        raise ValueError(f"{source}: kind = {data.get('kind')!r}, expected {kind!r}")
    return KindTemplate(**data)


# Where each kind's block lives in a run config, and how `grpoctl run` selects it (a logger is
# added beside jsonl, so the project's example run still writes metrics.jsonl).
_BLOCKS = {kind.name: kind.section for kind in COMPONENT_KINDS}
_CLI = {kind.name: f"'{kind.selector_key}=[jsonl,$name]'" if kind.many else f"{kind.selector_key}=$name"
        for kind in COMPONENT_KINDS}


def cli_selection(kind: str, name: str) -> str:
    """The `grpoctl run` override that selects component ``name`` of ``kind``."""
    return Template(_CLI[kind]).substitute(name=name)


def render(names: PluginNames, kind: str, sdk: str | None = None, *, template: str = DEFAULT_TEMPLATE
           ) -> dict[str, str]:
    """The project's files, path -> text; ``sdk`` is the grpo-sdk requirement (default: this major)."""
    t, label = load_template(kind, template), KIND_LABELS[kind]
    values = {"name": names.name, "dist": names.dist, "package": names.package, "kind": kind,
              "group": KINDS[kind], "label": label, "a_label": ("an " if label[0] in "aeiou" else "a ") + label,
              "summary": t.summary, "module": t.module, "protocol": t.protocol, "Impl": names.classes + t.suffix,
              "Config": names.classes + "Config", "block": f"{_BLOCKS[kind]}.{names.name}",
              "capabilities": t.capabilities, "options": t.options, "api": PLUGIN_API_VERSION}
    values["usage"] = Template(t.usage).substitute(values)
    values["cli"] = cli_selection(kind, names.name)
    values["dependencies"] = ", ".join(f'"{d}"' for d in (sdk or sdk_requirement(), *t.dependencies))
    values["components"] = ", ".join(f'"{Template(c).substitute(values)}"' for c in t.components)
    root = template_root()
    return {Template(path).substitute(values): Template((root / source).read_text(encoding="utf-8")).substitute(values)
            for path, source in t.files.items()}


def write_project(directory: Path, files: dict[str, str]) -> list[Path]:
    """Write ``files`` under ``directory``, which must be absent or empty (nothing is overwritten)."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} already exists and is not an empty directory")
    written = []
    for relative, text in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
