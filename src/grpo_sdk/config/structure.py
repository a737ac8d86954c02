"""Structuring raw config data into the classes of ``grpo_sdk.config.schema``, strictly.

cattrs does the structuring (detailed validation, ``forbid_extra_keys``); the hooks here make it
strict and the report complete, every problem at once with its full path:

* unknown keys are errors naming the full path, with a did-you-mean;
* ``"false"`` is not a bool, ``3.9`` is not an int, ``"abc"`` is not a list; an int must fit in 64
  bits, a number in a float32, and a string may not hold NUL;
* every field's validator runs on its own, so each failing field is reported, not the first;
* a pluggable section's selected block is structured against the plugin's own config class
  (the registry imports only the light config module), unselected blocks are kept as written;
* a key a class lists in ``__removed__`` (``schema.RemovedOption``) is dropped at a value that had
  no effect, so an older run's ``config.resolved.yaml`` still loads, and is an error otherwise.

Example::

    cfg = Structurer(registry).structure({"policy": {"model_name": "m"}})
    cfg.policy.generation.backend   # "hf"
"""

from __future__ import annotations

import difflib
import json
import math
import threading
import typing
from typing import Any, Callable, Iterator

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory, list_structure_factory, mapping_structure_factory
from cattrs.errors import AttributeValidationNote, ClassValidationError, ForbiddenExtraKeysError, \
    IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn, override

from grpo_sdk.config import schema as C
from grpo_sdk.config.files import describe
from grpo_sdk.core.errors import ConfigError, PluginError
from grpo_sdk.core.imports import import_target


# --- strict leaves --------------------------------------------------------------------------------


INT64 = 2**63  # torch, numpy, JSON readers and C APIs take 64-bit integers; a larger one crashes them
FLOAT32_MAX = 3.4028234663852886e38  # a clip of 1e308 overflows when torch turns it into a float32 tensor


def _strict_int(value: Any, _t: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {describe(value)}")
    if not -INT64 <= value < INT64:
        raise ValueError(f"{describe(value)} is out of range: integers must fit in 64 bits (|n| < 2**63)")
    return value


def _strict_float(value: Any, _t: Any) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"expected a finite number, got {describe(value)}, too large for a float") from None
    elif isinstance(value, str):  # PyYAML reads `1e-5` (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ValueError(f"expected a number, got {describe(value)}")
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r} (use null to disable an optional setting)")
    if abs(number) > FLOAT32_MAX:
        raise ValueError(f"{number:g} is out of range: numbers must fit in a 32-bit float (|x| <= 3.4e38), the "
                         "dtype of the tensors they are applied to")
    return number


def _strict_bool(value: Any, _t: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {describe(value)}")
    return value


def _strict_str(value: Any, _t: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {describe(value)}")
    if "\x00" in value:  # no path, name or template may hold one; os and tokenizers reject it later
        raise ValueError(f"contains a NUL character (\\x00): {value[:40]!r}")
    return value


def _strict_literal(value: Any, type_: Any) -> Any:
    choices = typing.get_args(type_)
    if not any(value == c and type(value) is type(c) for c in choices):  # True is not 1
        raise ValueError(f"expected one of {', '.join(map(repr, choices))}, got {describe(value)}")
    return value


def _validator_message(exc: BaseException, value: Any) -> str:
    text = str(exc)
    # attrs' comparison validators say "'x' must be > 0: 0"; keep the rule, drop the repeated name.
    if text.startswith("'") and "' must be" in text:
        text = "must be" + text.split("' must be", 1)[1]
    return text or f"invalid value {value!r}"


class _PluginProblem(Exception):
    """A selected plugin that cannot be used: reported at the selector, exit code 3 unless config problems
    come with it."""


def _at(key: str, exc: Exception) -> Exception:
    """``exc`` as the problem of ``key`` of the section being structured (the note cattrs attaches)."""
    exc.__notes__ = [*getattr(exc, "__notes__", []), AttributeValidationNote(f"@ attribute {key}", key, None)]
    return exc


def _join(prefix: str, rest: str) -> str:
    if not prefix or not rest:
        return prefix or rest
    return f"{prefix}{rest}" if rest.startswith("[") else f"{prefix}.{rest}"


def _problems(exc: BaseException, path: str = "") -> Iterator[tuple[str, str, bool]]:
    """(full path, message, is_plugin_problem) of every leaf of cattrs' exception tree."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        noted, others = exc.group_exceptions()
        for sub, note in noted:
            where = f"[{note.index}]" if isinstance(note, IterableValidationNote) else note.name
            yield from _problems(sub, _join(path, where))
        for sub in others:
            yield from _problems(sub, path)
    elif isinstance(exc, KeyError):  # cattrs looked the field up: it is required
        yield path, "required field missing", False
    else:
        yield path, str(exc) or type(exc).__name__, isinstance(exc, _PluginProblem)


# --- sections -------------------------------------------------------------------------------------


@attrs.frozen
class _Section:
    """What structuring one attrs class needs, computed once per class."""

    cls: type
    fields: dict[str, attrs.Attribute]  # the keys users write
    subsections: tuple[str, ...]  # fields that are attrs classes: structured from {} when left out
    structure: Callable[[dict[str, Any], type], Any]  # cattrs' generated function
    slot: C.PluginSlot | None
    removed: dict[str, C.RemovedOption]


class Structurer:
    """Structures raw mappings into config classes, collecting every problem with its path.

    ``sections``: extra top-level section name -> ``"module:Class"`` (from hook plugins).
    """

    def __init__(self, registry: Any, sections: dict[str, str] | None = None):
        self.registry = registry
        self.sections = sections or {}
        self._warnings: list[tuple[str, str]] = []
        self._path: list[str] = []  # where structuring is, for messages that need the full path
        self._lock = threading.Lock()
        conv = self.converter = cattrs.Converter(detailed_validation=True, forbid_extra_keys=True)
        for type_, hook in ((int, _strict_int), (float, _strict_float), (bool, _strict_bool), (str, _strict_str)):
            conv.register_structure_hook(type_, hook)
        conv.register_structure_hook_func(lambda t: typing.get_origin(t) is typing.Literal, _strict_literal)
        conv.register_structure_hook_factory(lambda t: typing.get_origin(t) in (list, tuple, dict),
                                             self._container_hook)
        conv.register_structure_hook_factory(attrs.has, self._section_hook)

    def structure(self, raw: Any, cls: type = C.MasterConfig, *,
                  warnings: list[tuple[str, str]] | None = None) -> Any:
        """``raw`` as ``cls``, or a ConfigError (PluginError when only plugins are the problem) listing every
        problem; ``warnings`` receives (path, message) of what was accepted but dropped (removed keys)."""
        with self._lock:  # the path and the warnings are per call
            self._warnings, self._path = [] if warnings is None else warnings, []
            try:
                return self.converter.structure(raw, cls)
            except (cattrs.BaseValidationError, ValueError) as exc:
                problems = list(_problems(exc))
        config = [(p, m) for p, m, plugin in problems if not plugin]
        plugin = [(p, m) for p, m, is_plugin in problems if is_plugin]
        if config:
            raise ConfigError(config + plugin) from None
        raise PluginError("\n".join(f"{p}: {m}" for p, m in plugin)) from None

    # --- hooks ---

    def _container_hook(self, type_: Any) -> Callable[[Any, Any], Any]:
        """cattrs' own list/tuple/dict hook, behind a shape check: it would take "abc" as a list of three."""
        origin, args = typing.get_origin(type_), typing.get_args(type_)
        if origin is dict:
            inner, shape = mapping_structure_factory(type_, self.converter), (dict,)
        elif origin is list:
            inner, shape = list_structure_factory(type_, self.converter), (list, tuple)
        elif not args or args[-1] is Ellipsis:
            inner, shape = homogenous_tuple_structure_factory(type_, self.converter), (list, tuple)
        else:
            inner, shape = self.converter.gen_structure_hetero_tuple(type_), (list, tuple)

        def hook(value: Any, _t: Any) -> Any:
            if not isinstance(value, shape):
                raise ValueError(f"expected a {'mapping' if origin is dict else 'list'}, got {describe(value)}")
            if origin is tuple and args and args[-1] is not Ellipsis and len(value) != len(args):
                raise ValueError(f"expected a list of {len(args)} values, got {describe(value)}")
            return inner(value, type_)
        return hook

    def _section_hook(self, cls: type) -> Callable[[Any, Any], Any]:
        attrs.resolve_types(cls)
        overrides, fields = {}, {}
        for field in attrs.fields(cls):
            if field.metadata.get("internal"):
                overrides[field.name] = override(omit=True)
                continue
            fields[field.name] = field
            if field.validator is not None or attrs.has(field.type):
                overrides[field.name] = override(struct_hook=self._field_hook(field))
        section = _Section(cls=cls, fields=fields, subsections=tuple(n for n, f in fields.items() if attrs.has(f.type)),
                           structure=make_dict_structure_fn(cls, self.converter, **overrides),
                           slot=getattr(cls, "__plugin__", None), removed=getattr(cls, "__removed__", {}))
        return lambda data, _t: self._structure_section(section, data)

    def _field_hook(self, field: attrs.Attribute) -> Callable[[Any, Any], Any]:
        """Structure one field (keeping the path) and run its validator here, so every failing field is
        reported; attrs' ``__init__`` would stop at the first."""
        def hook(value: Any, type_: Any) -> Any:
            self._path.append(field.name)
            try:
                result = self.converter.structure(value, type_)
            finally:
                self._path.pop()
            if field.validator is not None:
                try:
                    field.validator(None, field, result)
                except (ValueError, TypeError) as exc:
                    raise ValueError(_validator_message(exc, result)) from None
            return result
        return hook

    def _structure_section(self, section: _Section, data: Any) -> Any:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"expected a mapping, got {describe(data)}")
        slot, errors = section.slot, []
        own: dict[str, Any] = {}  # the section's own keys, and unknown ones for cattrs to report
        raw_blocks: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            block = self._block_name(slot, key, data) if slot is not None and isinstance(key, str) else None
            if not isinstance(key, str):  # `1: x` or `null: x` in YAML
                errors.append(_at(str(key), ValueError(f"a key must be a string, got {describe(key)}")))
            elif key in section.removed and key not in section.fields:
                self._removed(key, section.removed[key], value, errors)
            elif block is not None and key not in section.fields:
                if block in raw_blocks:
                    errors.append(_at(key, ValueError(f"block {block!r} is given twice (as {block!r} and "
                                                      f"{block + '_cfg'!r})")))
                if value is not None and not isinstance(value, dict):
                    errors.append(_at(key, ValueError(f"a plugin block must be a mapping, got {describe(value)}")))
                    value = {}
                raw_blocks[block] = value or {}
            elif section.cls is C.MasterConfig and key in self.sections:
                extra[key] = value
            else:
                own[key] = value
        for name in section.subsections:  # a section left out: its nested defaults and plugin blocks fill in
            own.setdefault(name, {})

        instance = None
        try:
            instance = section.structure(own, section.cls)
        except ClassValidationError as exc:
            for sub in exc.exceptions:
                errors.extend(self._unknown_keys(sub, section, data) if isinstance(sub, ForbiddenExtraKeysError)
                              else [sub])
        changes: dict[str, Any] = {}
        if slot is not None:
            changes = {"raw_blocks": raw_blocks,
                       "structured_blocks": self._plugin_blocks(section, own, raw_blocks, errors)}
        if section.cls is C.MasterConfig:
            changes["extra_sections"] = self._extra_sections(extra, errors)
        if errors:
            raise ClassValidationError(f"While structuring {section.cls.__name__}", errors, section.cls)
        return attrs.evolve(instance, **changes) if changes else instance

    # --- pluggable sections ---

    def _block_name(self, slot: C.PluginSlot, key: str, data: dict[str, Any]) -> str | None:
        """The plugin a key's block belongs to (``vllm`` for ``vllm`` or NeMo-RL's ``vllm_cfg``), or None.

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

    def _selected(self, section: _Section, own: dict[str, Any]) -> list[str] | None:
        """The plugin names the selector holds, or None when it is not valid (cattrs reports that)."""
        slot, field = section.slot, section.fields[section.slot.selector]
        if slot.selector not in own:
            default = field.default
            value = default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]
        else:
            try:
                value = self.converter.structure(own[slot.selector], field.type)
            except Exception:  # noqa: BLE001 - reported by the section's own structuring
                return None
        return list(value) if slot.many else [value]

    def _plugin_blocks(self, section: _Section, own: dict[str, Any], raw_blocks: dict[str, Any],
                       errors: list[Exception]) -> dict[str, Any]:
        structured: dict[str, Any] = {}
        slot = section.slot
        for name in self._selected(section, own) or []:
            self._path.append(name)
            try:
                structured[name] = self._plugin_block(slot, name, raw_blocks.get(name))
            except _PluginProblem as exc:  # a plugin that cannot be used is the selector's problem
                errors.append(_at(slot.selector, exc))
            except (cattrs.BaseValidationError, ValueError) as exc:  # a bad option is the block's
                errors.append(_at(name, exc))
            finally:
                self._path.pop()
        return structured

    def _plugin_block(self, slot: C.PluginSlot, name: str, block: dict[str, Any] | None) -> Any:
        try:
            config_cls = self.registry.load_config_class(slot.kind, name)
        except PluginError as exc:
            raise _PluginProblem(str(exc)) from None
        if config_cls is None:
            if block:
                raise ValueError(f"{name} takes no options, got {sorted(map(str, block))}")
            return None
        return self.converter.structure(block or {}, config_cls)

    def _extra_sections(self, extra: dict[str, Any], errors: list[Exception]) -> dict[str, Any]:
        structured: dict[str, Any] = {}
        for key, value in extra.items():
            try:
                cls = import_target(self.sections[key])
            except Exception as exc:  # noqa: BLE001 - a hook plugin's broken section must not be a traceback
                errors.append(_at(key, _PluginProblem(f"config section class {self.sections[key]} failed to "
                                                      f"import: {type(exc).__name__}: {exc}")))
                continue
            self._path.append(key)
            try:
                structured[key] = self.converter.structure(value, cls)
            except (cattrs.BaseValidationError, ValueError) as exc:
                errors.append(_at(key, exc))
            finally:
                self._path.pop()
        return structured

    # --- messages ---

    def _removed(self, key: str, removed: C.RemovedOption, value: Any, errors: list[Exception]) -> None:
        matches = [i for i, inert in enumerate(removed.inert) if inert == value and type(inert) is type(value)]
        if not matches:
            shown = " or ".join(json.dumps(v) for v in removed.inert)
            errors.append(_at(key, ValueError(f"this option was removed: {removed.why}; delete the key (saved "
                                              f"configs that hold {shown} still load)")))
        elif matches[0] > 0:  # the old default is dropped silently: every resolved config lists it
            self._warnings.append((_join(".".join(self._path), key), f"removed option, ignored: {removed.why}; "
                                                                    "delete the key"))

    def _unknown_keys(self, exc: ForbiddenExtraKeysError, section: _Section, data: dict[str, Any]) -> list[Exception]:
        return [_at(key, ValueError(self._unknown_key_message(key, section, data)))
                for key in data if key in exc.extra_fields]

    def _unknown_key_message(self, key: str, section: _Section, data: dict[str, Any]) -> str:
        slot = section.slot
        candidates = list(section.fields) + (self.registry.names(slot.kind) if slot else [])
        if section.cls is C.MasterConfig:
            candidates += list(self.sections)
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        if close:
            return f"unknown key {key!r} (did you mean {close[0]!r}?)"
        if slot is not None:  # a plugin option written at the section level
            path = ".".join(self._path)
            for name in self._selected(section, data) or []:
                try:
                    config_cls = self.registry.load_config_class(slot.kind, name) if isinstance(name, str) else None
                except PluginError:
                    config_cls = None
                if config_cls is not None and key in attrs.fields_dict(config_cls):
                    return f"unknown key {key!r} (it is an option of {name}: did you mean '{_join(path, name)}.{key}'?)"
        return f"unknown key {key!r}"
