"""Reward functions (and agents) named in a config as ``"module:function"``, and the callables
they name: ``resolve`` imports one (the environments that call such functions and their config
checks share it), ``reference_for`` gives a Python object passed through the API an entry of its
own (``module:qualname``, or a process-local ``callable:<name>#<n>``).
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Callable

from grpo_sdk.plugins import ConfigError, PluginError
from grpo_sdk.plugins.toolkit import import_module_here_too

# "module:function" (dotted on both sides: "pkg.rewards:Rewards.score"), or a process-local
# reference to a callable passed through the Python API ("callable:<name>#<n>").
FUNCTION_ENTRY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
LOCAL_REFERENCE = re.compile(r"^callable:[^#\s]+#\d+$")

_CALLABLES: dict[str, Callable[..., Any]] = {}  # process-local references -> the callables given
_CALLABLES_LOCK = threading.Lock()


def reference_for(fn: Callable[..., Any]) -> str:
    """The ``env.reward_functions.functions`` entry for a callable: ``module:qualname`` when
    importing that gives ``fn`` back (``__main__:name`` for a script's or notebook's function), else
    a process-local ``callable:<name>#<n>`` (lambdas, closures, partials, bound methods), resolved
    from a table of this process; the same object always gets the same reference."""
    if not callable(fn):
        raise TypeError(f"a reward function must be callable, got {type(fn).__name__} {fn!r}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        entry = f"{module}:{qualname}"
        try:
            if _import_attribute(module, qualname) is fn:
                return entry
        except Exception:  # noqa: BLE001 - not importable by name: a process-local reference instead
            pass
    with _CALLABLES_LOCK:
        for reference, known in _CALLABLES.items():
            if known is fn:
                return reference
        reference = f"callable:{name_of(fn)}#{len(_CALLABLES) + 1}"
        _CALLABLES[reference] = fn
        return reference


def name_of(fn: Any) -> str:
    """A function's ``__name__`` (a callable object's class name), as a metric-safe name: ``<lambda>`` -> ``lambda``."""
    name = getattr(fn, "__name__", None)
    name = name if isinstance(name, str) and name else type(fn).__name__
    return "".join(c for c in name if c.isalnum() or c == "_") or "function"


def _import_attribute(module_name: str, attr: str) -> Any:
    """``module:attr``, the module found among installed packages first, then in the current directory."""
    obj = import_module_here_too(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve(entry: str, key: str) -> Callable[..., Any]:
    """The callable an entry names, or a ConfigError/PluginError at ``key`` that says why not."""
    with _CALLABLES_LOCK:
        if entry in _CALLABLES:
            return _CALLABLES[entry]
    if LOCAL_REFERENCE.match(entry):
        raise ConfigError([(key, f"{entry!r} is a reward function passed as a Python object to another process "
                            "(grpo_sdk.train(reward_funcs=[...])); this process cannot see it. Pass it again "
                            "through the Python API, or define it in a module and name it 'module:function'")])
    module_name, _, attr = entry.partition(":")
    try:
        fn = _import_attribute(module_name, attr)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise PluginError(f"{key}: importing {module_name!r} for {entry!r} failed: {exc}") from exc
        raise ConfigError([(key, f"{entry!r}: no module {exc.name!r} among the installed packages or in the current "
                            f"directory ({os.getcwd()})")]) from None
    except AttributeError as exc:
        where = (": it was defined in the script or notebook that started the run; pass it again through the "
                 "Python API (grpo_sdk.train(reward_funcs=[...])), or move it to a module and name that"
                 if module_name == "__main__" else "")
        raise ConfigError([(key, f"{entry!r}: {exc}{where}")]) from None
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises while it is imported
        raise PluginError(f"{key}: importing {module_name!r} for {entry!r} raised {type(exc).__name__}: {exc}"
                          ) from exc
    if not callable(fn):
        raise ConfigError([(key, f"{entry!r} is a {type(fn).__name__}, not a function")])
    return fn
