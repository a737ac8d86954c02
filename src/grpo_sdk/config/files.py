"""The raw layer of a run config: YAML files, their ``defaults:`` chains, and dotted overrides.

Precedence is class defaults < files (left to right) < overrides, as in vLLM, Lightning and TRL.
Override grammar (the Hydra subset): ``a.b=v`` sets, ``~a.b`` deletes (back to the default),
``+a.b=v`` and ``++a.b=v`` also set. Values are YAML (``8``, ``true``, ``null``, ``[1, 2]``).
A file may inherit with a top-level ``defaults: base.yaml`` (or a list), paths relative to it.

Files must be regular UTF-8 files; a key given twice in one mapping, nesting past 64 levels, an
alias cycle and an alias bomb are errors naming the file and line (YAML itself would keep the
second key silently). What comes out is plain data; ``grpo_sdk.config.loading`` structures it.
"""

from __future__ import annotations

import copy
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from grpo_sdk.core.errors import ConfigError

BUILTIN_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_reverse.yaml"


MAX_DEFAULTS_DEPTH = 64  # a `defaults:` chain deeper than this is a mistake, not a recipe
MAX_NESTING = 64  # a config nests a handful of levels; merging, structuring and dumping recurse per level
MAX_VALUES = 1_000_000  # values once YAML aliases are expanded (`config show --format json` expands them)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: YAML keeps the last silently, so a
    second ``grpo:`` block would replace the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then a key overrides it, by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if seen is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line {seen.line + 1}); YAML would keep "
                    "only the second silently, so merge the two", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


# YAML 1.2 booleans only: PyYAML follows YAML 1.1, where yes/no/on/off/y/n are booleans too, so
# `data.shuffle=yes` or `name: off` would pass as booleans (or turn a string option into one).
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> data; any problem is a one-line ConfigError naming ``where`` and the line."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = f" ({exc.context})" if exc.context and exc.context_mark is not None else ""
        raise ConfigError([("", f"{where}{at}: not valid YAML: {exc.problem}{context}")]) from None
    except yaml.reader.ReaderError as exc:
        line = text[:exc.position].count("\n") + 1
        char = chr(exc.character) if isinstance(exc.character, int) else exc.character
        raise ConfigError([("", f"{where} line {line}: not valid YAML: character {char!r} is not allowed in "
                                "YAML (a binary file?)")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("", f"{where}: not valid YAML: {' '.join(str(exc).split())}")]) from None
    except RecursionError:  # PyYAML builds nested nodes recursively
        raise ConfigError([("", f"{where}: nested too deeply to read (a config needs a few levels)")]) from None
    problem = _shape_problem(data)
    if problem:
        raise ConfigError([("", f"{where}: {problem}")])
    return data


def _shape_problem(data: Any) -> str | None:
    """What makes ``data`` no config tree: nesting past MAX_NESTING, an alias inside its own anchor (a
    cycle), or aliases expanding past MAX_VALUES. Iterative, so it cannot hit the recursion limit itself."""
    done: dict[int, tuple[int, int]] = {}  # id -> (depth, values once expanded)
    path: set[int] = set()  # the containers being visited: meeting one again is a cycle
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, leaving = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        children = list(node.values()) if isinstance(node, dict) else node
        inner = [c for c in children if isinstance(c, (dict, list))]
        if leaving:
            path.discard(id(node))
            depth = 1 + max((done[id(c)][0] for c in inner), default=0)
            values = 1 + len(children) - len(inner) + sum(done[id(c)][1] for c in inner)
            if depth > MAX_NESTING:
                return f"nested more than {MAX_NESTING} levels deep (a config needs a few)"
            if values > MAX_VALUES:
                return f"expands to more than {MAX_VALUES:,} values through YAML aliases"
            done[id(node)] = (depth, values)
        elif id(node) in path:
            return "a YAML alias refers to a mapping or list that contains it (a cycle)"
        elif id(node) not in done:
            path.add(id(node))
            stack.append((node, True))
            for child in inner:
                if id(child) in path:
                    return "a YAML alias refers to a mapping or list that contains it (a cycle)"
                stack.append((child, False))
    return None


def read_text(path: Path, what: str = "config file") -> str:
    """A regular file's text, UTF-8; anything else is a ConfigError naming the file (and line)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError([("", f"{what} not found: {path}")]) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise ConfigError([("", f"{what} {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})")]) from None
    if stat.S_ISDIR(mode):
        raise ConfigError([("", f"{what} {path} is a directory; give a YAML file")])
    if not stat.S_ISREG(mode):
        # A FIFO would block until a writer comes, and a device is no config: write the YAML to a file.
        raise ConfigError([("", f"{what} {path} is a {file_kind(mode)}, not a regular file; write the YAML to a "
                                "file and give that")])
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError([("", f"{what} {path}: cannot be read ({exc.strerror})")]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        utf16 = " (it looks like UTF-16)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError([("", f"{path} line {line}, column {column}: not UTF-8 (byte 0x{data[exc.start]:02x})"
                                f"{utf16}; save the file as UTF-8")]) from None


def file_kind(mode: int) -> str:
    kinds = [(stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")]
    return next((name for test, name in kinds if test(mode)), "special file")


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a config file, following its ``defaults:`` chain (base files first)."""
    path = Path(path).expanduser()
    via = f" (in `defaults:` of {_seen[-1]})" if _seen else ""
    try:
        text = read_text(path)
    except ConfigError as exc:
        raise ConfigError([("", exc.problems[0][1] + via)]) from None
    if path.resolve() in _seen:
        raise ConfigError([("", f"config file {path} inherits from itself through `defaults:`")])
    if len(_seen) >= MAX_DEFAULTS_DEPTH:
        raise ConfigError([("", f"{path}: the `defaults:` chain is more than {MAX_DEFAULTS_DEPTH} files deep")])
    data = parse_yaml(text, str(path))
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError([("", f"{path} must hold a mapping at the top level, not {type(data).__name__}")])
    bases = data.pop("defaults", None)
    bases = [] if bases is None else [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list):
        raise ConfigError([("", f"{path}: `defaults:` must be a file name or a list of file names, got "
                                f"{describe(bases)}")])
    merged: dict[str, Any] = {}
    for i, base in enumerate(bases):
        if not isinstance(base, str) or not base.strip():
            raise ConfigError([("", f"{path}: `defaults:` item {i} must be a file name, got {describe(base)}")])
        merged = deep_merge(merged, read_yaml(path.parent / base, _seen + (path.resolve(),)))
    return deep_merge(merged, data)


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(raw: dict[str, Any], text: str) -> None:
    """Apply one ``key.path=value`` / ``~key.path`` override to a raw config in place."""
    if text.startswith("~"):
        if "=" in text:
            raise ConfigError([("", f"override {text!r}: `~key` resets a key to its default and takes no value")])
        *parents, leaf = text[1:].split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return
        if isinstance(node, dict):
            node.pop(leaf, None)
        return
    key, sep, value_text = text.lstrip("+").partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError([("", f"override {text!r} is not of the form key.path=value")])
    shown = value_text if len(value_text) <= 40 else value_text[:37] + "..."
    try:
        value = parse_yaml(value_text, f"override value {shown!r}") if value_text.strip() else ""
    except ConfigError as exc:
        raise ConfigError([(key, exc.problems[0][1])]) from None
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError([(".".join(parents[: i + 1]), f"is a {type(child).__name__}, cannot set {key}")])
        node = child
    node[leaf] = value


def raw_config(files: list[str] | None, overrides: list[str] | None) -> dict[str, Any]:
    """Merge files and overrides; with no file, start from the built-in recipe."""
    raw: dict[str, Any] = {}
    for path in files or [str(BUILTIN_RECIPE)]:
        raw = deep_merge(raw, read_yaml(path))
    for text in overrides or []:
        apply_override(raw, text)
    return raw


def describe(value: Any) -> str:
    """``value`` for a message: strings as written, anything else with its type; long ones cut."""
    text = repr(value)
    if len(text) > 60:  # a 400-digit integer or a 5000-character string: its start says enough
        text = f"{text[:40]}... ({len(text)} characters)"
    return text if isinstance(value, str) else f"{text} ({type(value).__name__})"
