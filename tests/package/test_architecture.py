"""The package layering the architecture promises, checked on the source (no imports run).

``grpo_sdk.core`` is the contract layer (protocols, records, errors, kinds, capabilities): it imports
nothing else of grpo-sdk. ``grpo_sdk.config`` (schema, loading, checks, run context) sits on it and
imports nothing else, and no two packages import each other (directly or through others). Data
loading (``grpo_sdk.data``) knows only the contract; the rollouts (``grpo_sdk.rollouts``) sit below
the trainer and never import it. Inside a package no two modules import each other either.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "grpo_sdk"


def package_of(module: str) -> str:
    """``grpo_sdk.config.schema`` -> ``config``; a top-level module (``grpo_sdk.x``) is its own
    node, and ``grpo_sdk`` itself (``__version__``) is ``(root)``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every grpo_sdk module this file imports, anywhere in it (lazy imports inside functions too)."""
    relative = path.relative_to(SRC.parent).with_suffix("")
    here = list(relative.parts if relative.name != "__init__" else relative.parts[:-1])
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "grpo_sdk"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "grpo_sdk":
                found.append((node.lineno, target))
    return found


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> where: ``file:line -> module``."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        source = package_of(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for line, target in imports_of(path):
            dest = package_of(target)
            if dest != source:
                edges.setdefault((source, dest), []).append(f"{path.relative_to(SRC)}:{line} -> {target}")
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt):]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    found.append(cycle + [nxt])
            elif len(path) < 8:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_core_imports_nothing_else_of_grpo_sdk():
    out_of_core = {k: v for k, v in package_edges().items() if k[0] == "core"}
    assert not out_of_core, "grpo_sdk.core must be a leaf; it imports:\n" + "\n".join(
        line for where in out_of_core.values() for line in where)


def test_config_imports_only_the_contract():
    """The config package is read by `grpoctl config validate` before anything is built: it knows
    the contract (``core``) and nothing above it (no plugin, backend or trainer module)."""
    outside = {k: v for k, v in package_edges().items() if k[0] == "config" and k[1] != "core"}
    assert not outside, "grpo_sdk.config may import only grpo_sdk.core; it imports:\n" + "\n".join(
        line for where in outside.values() for line in where)


def test_no_cycle_between_packages():
    edges = package_edges()
    found = cycles(edges)
    detail = []
    for cycle in found:
        for a, b in zip(cycle, cycle[1:]):
            detail.append(f"{a} -> {b}: " + "; ".join(edges[(a, b)][:3]))
    assert not found, "import cycles between packages:\n" + "\n".join(detail)


def test_data_and_rollouts_sit_below_the_trainer():
    """Prompts are read and drawn with the contract and the config alone (``grpo_sdk.data``); the
    rollouts use the data, the serving layer and the runtime, and the trainer drives them, never the
    other way."""
    edges = package_edges()
    outside = [line for (a, b), where in edges.items() for line in where
               if (a == "data" and b not in ("core", "config")) or (a == "rollouts" and b in ("trainer", "cli", "api", "testing"))]
    assert not outside, ("grpo_sdk.data may import only grpo_sdk.core and grpo_sdk.config, and grpo_sdk.rollouts nothing above it "
                         "(trainer, cli, api, testing); they import:\n" + "\n".join(outside))


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_edges() -> dict[tuple[str, str], list[str]]:
    """(module, module) -> where, for two modules of the same package (``grpo_sdk.data.prompts`` and
    ``grpo_sdk.data.hub``; a package's ``__init__`` counts as a module of its parent). Module-level
    and lazy imports both count; ``from pkg import name`` is an import of ``pkg.name`` when that is
    a module."""
    modules = {module_name(path): path for path in SRC.rglob("*.py")}
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in sorted(modules.items()):
        for line, target, names in imports_with_names(path):
            for dest in [target] + [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]:
                if dest != name and dest in modules and dest.rpartition(".")[0] == name.rpartition(".")[0]:
                    edges.setdefault((name, dest), []).append(f"{path.relative_to(SRC)}:{line}")
    return edges


def imports_with_names(path: Path) -> list[tuple[int, str, list[str]]]:
    """``imports_of`` with the names each ``from ... import`` takes (empty for ``import x``)."""
    names_at: dict[int, list[list[str]]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            names_at.setdefault(node.lineno, []).append([a.name for a in node.names])
    out = []
    for line, target in imports_of(path):
        taken = names_at.get(line, [])
        out.append((line, target, taken.pop(0) if taken else []))
    return out


def test_no_cycle_between_modules_of_one_package():
    """A module that imports a sibling which imports it back (even lazily, inside a function) is
    two modules that cannot be read, tested or moved apart: the shared piece belongs in one of
    them, or in a third that both import."""
    edges = module_edges()
    found = cycles(edges)
    detail = []
    for cycle in found:
        detail.append(" -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            detail.append(f"    {a.rpartition('.')[2]} imports {b.rpartition('.')[2]} at " + ", ".join(edges[(a, b)][:3]))
    assert not found, "import cycles between modules of one package:\n" + "\n".join(detail)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    # The checks above are only as good as the walker: it must see imports inside functions.
    path = SRC / "config" / "loading.py"
    assert any(target.startswith("grpo_sdk.config.") for _, target in imports_of(path))
    assert any(target.startswith("grpo_sdk.core.") for _, target in imports_of(path))
    assert imports_of(SRC / "cli" / "run_cmd.py"), "run_cmd imports grpo_sdk modules, lazily too"


BUILT_IN_PLUGIN_PACKAGES = ("backends", "estimators", "environments", "weight_sync", "loggers")
PUBLIC_PLUGIN_SUBMODULES = ("toolkit", "tensors", "training", "tools")  # documented in docs/plugins.md, compatibility.md


def test_built_in_components_import_only_the_public_plugin_api():
    """The built-ins register exactly as a third-party package would, imports included: each
    imports nothing of grpo-sdk but ``grpo_sdk.plugins`` (and its documented submodules) and
    its own package."""
    outside = []
    for package in BUILT_IN_PLUGIN_PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            for line, target in imports_of(path):
                parts = target.split(".")
                if len(parts) < 2 or parts[1] not in ("plugins", package):
                    outside.append(f"{path.relative_to(SRC)}:{line} -> {target}")
                elif parts[1] == "plugins" and parts[2:] and parts[2] not in PUBLIC_PLUGIN_SUBMODULES:
                    outside.append(f"{path.relative_to(SRC)}:{line} -> {target} (a private plugins module)")
    assert not outside, ("built-in components must import only grpo_sdk.plugins (and "
                         f"{', '.join('grpo_sdk.plugins.' + m for m in PUBLIC_PLUGIN_SUBMODULES)}); they import:\n"
                         + "\n".join(outside))


def test_no_backend_imports_another_backend():
    """Each built-in backend (``grpo_sdk.backends.<name>``) stands alone, as a third-party one would:
    what two of them share (the optimizer, the training loop, data-parallel helpers, colocation,
    sampling) is public in ``grpo_sdk.plugins``' submodules, never imported from the other backend.
    Lazy imports count too, and so does a module directly under ``backends`` (no shared private home)."""
    outside = []
    for path in sorted((SRC / "backends").rglob("*.py")):
        parts = path.relative_to(SRC / "backends").parts
        own = parts[0] if len(parts) > 1 else None
        for line, target in imports_of(path):
            names = target.split(".")
            # ``from grpo_sdk.backends import hf`` names the package only: a sibling all the same.
            if names[:2] == ["grpo_sdk", "backends"] and (len(names) == 2 or names[2] != own):
                outside.append(f"{path.relative_to(SRC)}:{line} -> {target}")
    assert not outside, "a backend imports another backend (make the shared piece public in grpo_sdk.plugins):\n" \
        + "\n".join(outside)


# Modules outside grpo_sdk.backends that still name a built-in backend, and why.
NAMES_A_BACKEND = {
    "cli/memory_plan.py": "whether hf generation shares the hf policy's model (backends.hf.config, light)",
}


def test_only_the_backends_name_a_backend():
    """The trainer, runtimes and commands reach a backend through the registry and the protocols
    (``grpoctl export`` merges LoRA adapters through the policy class's ``ExportsMergedModel``), never by
    importing ``grpo_sdk.backends``; the few exceptions are listed, each with its reason."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        where = str(path.relative_to(SRC))
        if where.startswith("backends/"):
            continue
        for line, target in imports_of(path):
            if target == "grpo_sdk.backends" or target.startswith("grpo_sdk.backends."):
                found.setdefault(where, []).append(f"{where}:{line} -> {target}")
    unlisted = [line for where, lines in found.items() if where not in NAMES_A_BACKEND for line in lines]
    assert not unlisted, "modules outside grpo_sdk.backends import a backend:\n" + "\n".join(unlisted)
    assert sorted(found) == sorted(NAMES_A_BACKEND), "NAMES_A_BACKEND lists a module that no longer names one"


def test_the_kinds_table_is_the_only_list_of_kinds():
    """core.kinds declares each kind once; the entry-point groups, labels, kit selectors and
    protocols, the scaffold's config blocks and the config's pluggable sections all follow it."""
    import attrs

    from grpo_sdk.cli import scaffold
    from grpo_sdk.config import schema as C
    from grpo_sdk.core.kinds import COMPONENT_KINDS
    from grpo_sdk.plugins import KINDS
    from grpo_sdk.plugins.registry import KIND_LABELS
    from grpo_sdk.testing import PROTOCOLS, SELECTORS

    names = [kind.name for kind in COMPONENT_KINDS]
    assert list(KINDS) == list(KIND_LABELS) == list(SELECTORS) == list(PROTOCOLS) == names

    def slots(cls: type, prefix: str = "") -> dict[str, C.PluginSlot]:
        found = {}
        for field in attrs.fields(attrs.resolve_types(cls)):
            inner = field.type
            if isinstance(inner, type) and attrs.has(inner):
                slot = getattr(inner, "__plugin__", None)
                if slot is not None:
                    found[prefix + field.name] = slot
                found.update(slots(inner, f"{prefix}{field.name}."))
        return found

    sections = slots(C.MasterConfig)
    assert {kind.section: (kind.name, kind.selector, kind.many) for kind in COMPONENT_KINDS} == \
        {path: (slot.kind, slot.selector, slot.many) for path, slot in sections.items()}
    for kind in COMPONENT_KINDS:
        assert isinstance(kind.protocol, type) and kind.protocol.__name__ == kind.protocol_name
        assert scaffold.cli_selection(kind.name, "acme").split("=")[0].strip("'") == kind.selector_key
