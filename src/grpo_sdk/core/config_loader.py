"""Loading a run config: defaults, then ``-c`` files, then dotted overrides, then strict structuring.

Precedence is class defaults < files (left to right) < overrides, as in vLLM, Lightning and TRL.
Override grammar (the Hydra subset): ``a.b=v`` sets, ``~a.b`` deletes (back to the default),
``+a.b=v`` and ``++a.b=v`` also set. Values are YAML (``8``, ``true``, ``null``, ``[1, 2]``).
A file may inherit with a top-level ``defaults: base.yaml`` (or a list), paths relative to it.

Files must be regular UTF-8 files; a key given twice in one mapping, nesting past 64 levels, an
alias cycle and an alias bomb are errors naming the file and line (YAML itself would keep the
second key silently).

Structuring is strict, and every problem is collected before anything is reported:

* unknown keys are errors naming the full path, with a did-you-mean;
* ``"false"`` is not a bool, ``3.9`` is not an int, ``"abc"`` is not a list; an int must fit in 64
  bits and a string may not hold NUL;
* a pluggable section's selected block is structured against the plugin's own config class
  (the registry imports only the light config module), unselected blocks are kept as written.

Example::

    cfg = load_config(["recipe.yaml"], ["grpo.num_prompts_per_step=8"], registry)
    cfg.grpo.num_prompts_per_step   # 8
"""

from __future__ import annotations

import copy
import difflib
import logging
import math
import stat
import types
import typing
from pathlib import Path
from typing import Any

import attrs
import cattrs
import yaml

from grpo_sdk.core import config as C
from grpo_sdk.core.config_checks import check_config, config_warnings
from grpo_sdk.core.errors import ConfigError, PluginError
from grpo_sdk.plugins.registry import import_target

log = logging.getLogger(__name__)

BUILTIN_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_reverse.yaml"


# --- raw layer: YAML files and overrides ------------------------------------------------------


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
                                f"{_describe(bases)}")])
    merged: dict[str, Any] = {}
    for i, base in enumerate(bases):
        if not isinstance(base, str) or not base.strip():
            raise ConfigError([("", f"{path}: `defaults:` item {i} must be a file name, got {_describe(base)}")])
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


# --- structuring ------------------------------------------------------------------------------


class _Problems(Exception):
    """Problems found below one node, as (relative path, message, is_plugin_problem)."""

    def __init__(self, items: list[tuple[str, str, bool]]):
        super().__init__(items)
        self.items = items


def _join(prefix: str, rest: str) -> str:
    if not rest:
        return prefix
    return f"{prefix}{rest}" if rest.startswith("[") else f"{prefix}.{rest}"


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:  # a 400-digit integer or a 5000-character string: its start says enough
        text = f"{text[:40]}... ({len(text)} characters)"
    return text if isinstance(value, str) else f"{text} ({type(value).__name__})"


INT64 = 2**63  # torch, numpy, JSON readers and C APIs take 64-bit integers; a larger one crashes them
FLOAT32_MAX = 3.4028234663852886e38  # a clip of 1e308 overflows when torch turns it into a float32 tensor


def _strict_int(value: Any, _t: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {_describe(value)}")
    if not -INT64 <= value < INT64:
        raise ValueError(f"{_describe(value)} is out of range: integers must fit in 64 bits (|n| < 2**63)")
    return value


def _strict_float(value: Any, _t: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {_describe(value)}")
    number = None
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"expected a finite number, got {_describe(value)}, too large for a float") from None
    elif isinstance(value, str):  # PyYAML reads `1e-5` (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ValueError(f"expected a number, got {_describe(value)}")
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r} (use null to disable an optional setting)")
    if abs(number) > FLOAT32_MAX:
        raise ValueError(f"{number:g} is out of range: numbers must fit in a 32-bit float (|x| <= 3.4e38), the "
                         "dtype of the tensors they are applied to")
    return number


def _strict_bool(value: Any, _t: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_describe(value)}")
    return value


def _strict_str(value: Any, _t: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_describe(value)}")
    if "\x00" in value:  # no path, name or template may hold one; os and tokenizers reject it later
        raise ValueError(f"contains a NUL character (\\x00): {value[:40]!r}")
    return value


def _leaf_converter() -> cattrs.Converter:
    conv = cattrs.Converter(detailed_validation=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    return conv


def _format_leaf_error(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, ValueError) and str(exc):
        return str(exc)
    if isinstance(exc, KeyError):
        return "required field missing"
    return f"invalid value for {getattr(type_, '__name__', type_)}"


class Structurer:
    """Structures raw mappings into config classes, collecting every problem with its path."""

    def __init__(self, registry: Any, sections: dict[str, str] | None = None):
        self.registry = registry
        self.sections = sections or {}  # extra top-level section name -> "module:Class"
        self.leaf = _leaf_converter()

    def structure(self, raw: dict[str, Any], cls: type = C.MasterConfig) -> Any:
        try:
            return self._value(raw, cls)
        except _Problems as problems:
            config = [(p, m) for p, m, plugin in problems.items if not plugin]
            plugin = [(p, m) for p, m, is_plugin in problems.items if is_plugin]
            if config:
                raise ConfigError(config + plugin) from None
            raise PluginError("\n".join(f"{p}: {m}" for p, m in plugin)) from None

    def _value(self, value: Any, type_: Any, path: str = "") -> Any:
        if attrs.has(type_):
            return self._attrs(value, type_, path)
        origin, args = typing.get_origin(type_), typing.get_args(type_)
        if type_ is Any:
            return value
        if origin in (typing.Union, types.UnionType) and type(None) in args:
            if value is None:
                return None
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1:
                return self._value(value, rest[0], path)
        if origin is typing.Literal:
            if value not in args:
                choices = ", ".join(repr(a) for a in args)
                raise _Problems([("", f"expected one of {choices}, got {_describe(value)}", False)])
            return value
        if origin in (list, tuple) and not isinstance(value, (list, tuple)):
            raise _Problems([("", f"expected a list, got {_describe(value)}", False)])
        if origin is tuple and args and Ellipsis not in args and len(value) != len(args):
            raise _Problems([("", f"expected a list of {len(args)} values, got {_describe(value)}", False)])
        if origin is list and args and attrs.has(args[0]):  # a list of sections: each one strictly
            items, problems = [], []
            for i, item in enumerate(value):
                try:
                    items.append(self._attrs(item, args[0], f"{path}[{i}]"))
                except _Problems as inner:
                    problems.extend((_join(f"[{i}]", p), m, pl) for p, m, pl in inner.items)
            if problems:
                raise _Problems(problems)
            return items
        if origin is dict and not isinstance(value, dict):
            raise _Problems([("", f"expected a mapping, got {_describe(value)}", False)])
        try:
            return self.leaf.structure(value, type_)
        except Exception as exc:  # noqa: BLE001 - cattrs raises exception groups per element
            messages = cattrs.transform_error(exc, path="", format_exception=_format_leaf_error)
            items = []
            for message in messages:
                text, _, where = message.rpartition(" @ ")
                items.append((where if where else "", text or message, False))
            raise _Problems(items) from None

    def _attrs(self, data: Any, cls: type, path: str = "") -> Any:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise _Problems([("", f"expected a mapping, got {_describe(data)}", False)])
        attrs.resolve_types(cls)
        fields = {f.name: f for f in attrs.fields(cls) if not f.metadata.get("internal")}
        slot: C.PluginSlot | None = getattr(cls, "__plugin__", None)
        problems: list[tuple[str, str, bool]] = []
        values: dict[str, Any] = {}
        blocks: dict[str, Any] = {}
        extra_sections: dict[str, Any] = {}

        for key, value in data.items():
            if not isinstance(key, str):  # `1: x` or `null: x` in YAML
                problems.append((str(key), f"a key must be a string, got {_describe(key)}", False))
                continue
            if key in fields:
                continue
            block_name = self._block_name(slot, key, data) if slot is not None else None
            if block_name is not None:
                name = block_name
                if name in blocks:
                    problems.append((key, f"block {name!r} is given twice (as {name!r} and {name + '_cfg'!r})", False))
                if value is not None and not isinstance(value, dict):
                    problems.append((key, f"a plugin block must be a mapping, got {_describe(value)}", False))
                    value = {}
                blocks[name] = value or {}
            elif cls is C.MasterConfig and key in self.sections:
                try:
                    extra_sections[key] = self._value(value, import_target(self.sections[key]))
                except _Problems as inner:
                    problems.extend((_join(key, p), m, pl) for p, m, pl in inner.items)
            else:
                problems.append((key, self._unknown_key_message(key, cls, fields, slot, data, path), False))

        for name, field in fields.items():
            if name in data:
                raw_value = data[name]
            elif attrs.has(field.type):  # a section left out: structure {} so nested defaults and blocks fill in
                raw_value = {}
            elif field.default is attrs.NOTHING:
                problems.append((name, "required field missing", False))
                continue
            else:
                continue
            try:
                values[name] = self._value(raw_value, field.type, f"{path}.{name}" if path else name)
            except _Problems as inner:
                problems.extend((_join(name, p), m, pl) for p, m, pl in inner.items)
                continue
            if field.validator is not None:
                try:
                    field.validator(None, field, values[name])
                except (ValueError, TypeError) as exc:
                    problems.append((name, _validator_message(exc, values[name]), False))

        configs: dict[str, Any] = {}
        if slot is not None and not any(p == slot.selector or p.startswith(slot.selector + "[") for p, _, _ in problems):
            selected = values.get(slot.selector, fields[slot.selector].default)
            if isinstance(selected, attrs.Factory):  # type: ignore[arg-type]
                selected = selected.factory()
            for name in selected if slot.many else [selected]:
                try:
                    configs[name] = self._plugin_block(slot, name, blocks.get(name), f"{path}.{name}" if path else name)
                except _Problems as inner:
                    # A plugin that cannot be used is the selector's problem; a bad option is the block's.
                    problems.extend((_join(slot.selector if pl else name, p), m, pl) for p, m, pl in inner.items)
        if problems:
            raise _Problems(problems)
        if slot is not None:
            values.update(blocks=blocks, configs=configs)
        if cls is C.MasterConfig:
            values["extra_sections"] = extra_sections
        return cls(**values)

    def _block_name(self, slot: C.PluginSlot, key: str, data: dict[str, Any]) -> str | None:
        """The plugin a key's block belongs to (``vllm`` for ``vllm`` or the seed's ``vllm_cfg``), or None.

        A block named after the selected plugin counts even when that plugin is not installed, so
        the run reports the one real problem (the plugin) rather than also an "unknown key".
        """
        selected = data.get(slot.selector)
        known = set(self.registry.names(slot.kind))
        known.update(selected if isinstance(selected, list) else [selected] if isinstance(selected, str) else [])
        if key in known:
            return key
        if key.endswith("_cfg") and key[: -len("_cfg")] in known:
            return key[: -len("_cfg")]
        return None

    def _plugin_block(self, slot: C.PluginSlot, name: str, block: dict[str, Any] | None, path: str = "") -> Any:
        try:
            config_cls = self.registry.load_config_class(slot.kind, name)
        except PluginError as exc:
            raise _Problems([("", str(exc), True)]) from None
        if config_cls is None:
            if block:
                raise _Problems([("", f"{name} takes no options, got {sorted(block)}", False)])
            return None
        return self._value(block or {}, config_cls, path)

    def _unknown_key_message(self, key: str, cls: type, fields: dict[str, Any], slot: C.PluginSlot | None,
                             data: dict[str, Any], path: str = "") -> str:
        candidates = list(fields) + (self.registry.names(slot.kind) if slot else [])
        if cls is C.MasterConfig:
            candidates += list(self.sections)
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        if close:
            return f"unknown key {key!r} (did you mean {close[0]!r}?)"
        if slot is not None:  # a plugin option written at the section level
            selected = data.get(slot.selector, getattr(fields[slot.selector], "default", None))
            for name in selected if isinstance(selected, list) else [selected]:
                try:
                    config_cls = self.registry.load_config_class(slot.kind, name) if isinstance(name, str) else None
                except PluginError:
                    config_cls = None
                if config_cls is not None and key in attrs.fields_dict(config_cls):
                    return f"unknown key {key!r} (it is an option of {name}: did you mean '{path + '.' if path else ''}{name}.{key}'?)"
        return f"unknown key {key!r}"


def _validator_message(exc: BaseException, value: Any) -> str:
    text = str(exc)
    # attrs' comparison validators say "'x' must be > 0: 0"; keep the rule, drop the repeated name.
    if text.startswith("'") and "' must be" in text:
        text = "must be" + text.split("' must be", 1)[1]
    return text or f"invalid value {value!r}"


def load_config(files: list[str] | None, overrides: list[str] | None, registry: Any) -> C.MasterConfig:
    """Defaults < files < overrides, structured strictly and cross-checked; raises ConfigError."""
    raw = raw_config(files, overrides)
    sections = {s.name: s.config for s in registry.host.config_sections()}
    cfg = Structurer(registry, sections).structure(raw)
    problems = check_config(cfg, registry)
    if problems:
        raise ConfigError(problems)
    # Not fatal, but loud: the CLI configures no logging, so these reach stderr as they are.
    for key, message in config_warnings(cfg, registry):
        log.warning("grpo-sdk: warning: %s: %s", key, message)
    return cfg


# --- dumping ----------------------------------------------------------------------------------


def dump_config(obj: Any) -> Any:
    """A YAML-ready dict of a config; selected plugin blocks are written out in full."""
    if attrs.has(type(obj)):
        out: dict[str, Any] = {}
        for field in attrs.fields(type(obj)):
            if field.metadata.get("internal"):
                continue
            out[field.name] = dump_config(getattr(obj, field.name))
        if getattr(type(obj), "__plugin__", None) is not None:
            for name, block in obj.blocks.items():
                out[name] = copy.deepcopy(block)
            for name, plugin_cfg in obj.configs.items():
                out[name] = dump_config(plugin_cfg) if plugin_cfg is not None else {}
        if isinstance(obj, C.MasterConfig):
            for name, section in obj.extra_sections.items():
                out[name] = dump_config(section)
        return out
    if isinstance(obj, (list, tuple)):
        return [dump_config(x) for x in obj]
    if isinstance(obj, dict):
        return {k: dump_config(x) for k, x in obj.items()}
    return obj


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(dump_config(cfg), sort_keys=False, default_flow_style=False)
