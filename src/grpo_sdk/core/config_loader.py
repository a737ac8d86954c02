"""Loading a run config: defaults, then ``-c`` files, then dotted overrides, then strict structuring.

Precedence is class defaults < files (left to right) < overrides, as in vLLM, Lightning and TRL.
Override grammar (the Hydra subset): ``a.b=v`` sets, ``~a.b`` deletes (back to the default),
``+a.b=v`` and ``++a.b=v`` also set. Values are YAML (``8``, ``true``, ``null``, ``[1, 2]``).
A file may inherit with a top-level ``defaults: base.yaml`` (or a list), paths relative to it.

Structuring is strict, and every problem is collected before anything is reported:

* unknown keys are errors naming the full path, with a did-you-mean;
* ``"false"`` is not a bool, ``3.9`` is not an int, ``"abc"`` is not a list;
* a pluggable section's selected block is structured against the plugin's own config class
  (the registry imports only the light config module), unselected blocks are kept as written.

Example::

    cfg = load_config(["recipe.yaml"], ["grpo.num_prompts_per_step=8"], registry)
    cfg.grpo.num_prompts_per_step   # 8
"""

from __future__ import annotations

import copy
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import attrs
import cattrs
import yaml

from grpo_sdk.core import config as C
from grpo_sdk.core.config_checks import check_config
from grpo_sdk.core.errors import ConfigError, PluginError
from grpo_sdk.plugins.registry import import_target

BUILTIN_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_reverse.yaml"


# --- raw layer: YAML files and overrides ------------------------------------------------------


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a config file, following its ``defaults:`` chain (base files first)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError([("", f"config file not found: {path}")])
    if path.resolve() in _seen:
        raise ConfigError([("", f"config file {path} inherits from itself through `defaults:`")])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([("", f"{path} is not valid YAML: {exc}")]) from exc
    if not isinstance(data, dict):
        raise ConfigError([("", f"{path} must hold a mapping at the top level, not {type(data).__name__}")])
    bases = data.pop("defaults", None) or []
    merged: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
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
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError([(key, f"override value {value_text!r} is not valid YAML: {exc}")]) from exc
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
    return repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def _strict_int(value: Any, _t: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {_describe(value)}")
    return value


def _strict_float(value: Any, _t: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {_describe(value)}")
    number = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):  # PyYAML reads `1e-5` (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ValueError(f"expected a number, got {_describe(value)}")
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r} (use null to disable an optional setting)")
    return number


def _strict_bool(value: Any, _t: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_describe(value)}")
    return value


def _strict_str(value: Any, _t: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_describe(value)}")
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
