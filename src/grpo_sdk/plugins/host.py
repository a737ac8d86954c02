"""The pluggy host: loads hook plugins one by one and calls hooks through typed methods.

Each hook module is loaded behind its own try/except, so one broken plugin is recorded and
reported instead of breaking every command (the llm #1280 and conda lessons). Every hook
implementation is guarded too: when a plugin is registered, each of its implementations is
wrapped so that an exception (or, for ``grpo_components`` / ``grpo_config_sections``, a result of
the wrong type) marks that plugin broken, is reported, and leaves the others to run. Hooks are
then called through pluggy itself, so ``tryfirst`` / ``trylast`` order and ``wrapper=True``
implementations work as pluggy documents. Observer hooks that raise during a run are reported and
do not stop training: an uploader must not kill a 12-hour run. ``GRPO_SDK_STRICT_PLUGINS=1``
turns every such failure into an error.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import os
import sys
from typing import Any

import attrs
import pluggy

from grpo_sdk.plugins import hookspecs
from grpo_sdk.plugins.specs import HOOKS_GROUP, ComponentSpec, ConfigSection


@attrs.frozen(kw_only=True)
class HookPluginInfo:
    """One hook plugin: a row of the ``hooks`` part of ``grpoctl plugins list``."""

    name: str
    status: str  # "ok" or "broken"
    module: str | None = None
    dist: str | None = None
    version: str | None = None
    hooks: tuple[str, ...] = ()
    problem: str | None = None

    def to_json(self) -> dict:
        return attrs.asdict(self)


def strict_plugins() -> bool:
    """``GRPO_SDK_STRICT_PLUGINS=1`` turns plugin load failures into errors."""
    return os.environ.get("GRPO_SDK_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes")


def describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0]


class PluginHost:
    """A pluggy manager plus the record of which hook plugins loaded and which failed."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[HookPluginInfo] = []
        self._origins: dict[int, str] = {}  # id(spec) -> the plugin whose grpo_components returned it

    def load_entry_points(self) -> None:
        for ep in md.entry_points(group=HOOKS_GROUP):
            dist = getattr(ep, "dist", None)
            self._register_guarded(
                ep.name, lambda ep=ep: ep.load(), module=ep.value,
                dist=dist.name if dist else None, version=dist.version if dist else None,
            )

    def load_module(self, module_name: str) -> None:
        """Register a module as a hook plugin (``grpoctl run -p pkg.module``)."""
        self._register_guarded(module_name, lambda: importlib.import_module(module_name), module=module_name)

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register an object in-process (tests, notebooks); errors propagate."""
        name = name or self.pm.get_canonical_name(plugin)
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()
        except Exception:
            self.pm.unregister(plugin)  # or every later registration fails on this plugin's hooks
            raise
        self._guard(plugin, name)
        self.plugins.append(HookPluginInfo(name=name, status="ok", hooks=self._hook_names(plugin)))

    def _register_guarded(self, name: str, load, **info: Any) -> None:
        from grpo_sdk.core.errors import PluginError

        plugin, registered = None, False
        try:
            plugin = load()
            if self.pm.is_registered(plugin):  # e.g. `-p mod` for an installed hook module: nothing to do
                return
            self.pm.register(plugin, name=name)
            registered = True
            self.pm.check_pending()
        except Exception as exc:  # noqa: BLE001 - any failure of a plugin is that plugin's problem
            if registered:
                self.pm.unregister(plugin)
            problem = describe_exception(exc)
            if strict_plugins():
                raise PluginError(f"hook plugin {name!r} failed to load: {problem}") from exc
            self.plugins.append(HookPluginInfo(name=name, status="broken", problem=problem, **info))
            return
        self._guard(plugin, name)
        self.plugins.append(HookPluginInfo(name=name, status="ok", hooks=self._hook_names(plugin), **info))

    def _hook_names(self, plugin: object) -> tuple[str, ...]:
        return tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()))

    # --- guarding each implementation -----------------------------------------------------------

    def _guard(self, plugin: object, name: str) -> None:
        """Wrap every hook implementation of ``plugin`` so that its failure is its own (see the module doc)."""
        for caller in self.pm.get_hookcallers(plugin) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    wrap = _guarded_wrapper if (impl.wrapper or impl.hookwrapper) else _guarded_call
                    impl.function = wrap(self, name, caller.name, impl.function)

    def _failed(self, plugin: str, hook: str, exc: BaseException | None, problem: str | None = None) -> None:
        """A hook implementation raised (or returned the wrong type): report it, mark its plugin broken."""
        from grpo_sdk.core.errors import PluginError

        problem = problem or describe_exception(exc)
        if strict_plugins():
            if exc is not None and hook.startswith(OBSERVER_PREFIXES):
                raise exc  # strict mode: an observer's own error, unchanged
            raise PluginError(f"hook {hook} of plugin {plugin!r} failed: {problem}") from exc
        print(f"grpo-sdk: hook {hook} of plugin {plugin!r} raised {problem}" if exc is not None else
              f"grpo-sdk: hook {hook} of plugin {plugin!r}: {problem}", file=sys.stderr)
        if hook.startswith(OBSERVER_PREFIXES):
            return  # an observer that fails at one step is reported each time, not disabled
        self.plugins = [attrs.evolve(p, status="broken", problem=f"{hook}: {problem}") if p.name == plugin else p
                        for p in self.plugins]

    # Typed facade: the only callers of pm.hook, so hook arguments are checked in one place.

    def components(self) -> list[tuple[str, ComponentSpec]]:
        """(plugin name, spec) for every component registered through ``grpo_components``."""
        self._origins.clear()
        specs = [spec for result in self.pm.hook.grpo_components() for spec in (result or ())]
        return [(self._origins.get(id(spec), "hook"), spec) for spec in specs]

    def config_sections(self) -> list[ConfigSection]:
        return [s for result in self.pm.hook.grpo_config_sections() for s in (result or ())]

    def cli_commands(self, app: Any) -> None:
        self.pm.hook.grpo_cli_commands(app=app)

    def notify(self, hook: str, **kwargs: Any) -> None:
        """Call an observer hook; a failing observer is reported, never fatal."""
        getattr(self.pm.hook, hook)(**kwargs)

    def run_start(self, run: Any) -> None:
        self.notify("grpo_run_start", run=run)

    def step_end(self, run: Any, step: int, metrics: dict[str, float]) -> None:
        self.notify("grpo_step_end", run=run, step=step, metrics=metrics)

    def checkpoint_saved(self, run: Any, step: int, path: str) -> None:
        self.notify("grpo_checkpoint_saved", run=run, step=step, path=path)

    def run_end(self, run: Any, status: str, error: BaseException | None) -> None:
        self.notify("grpo_run_end", run=run, status=status, error=error)


# --- the guards ---------------------------------------------------------------------------------

OBSERVER_PREFIXES = ("grpo_run_", "grpo_step_", "grpo_checkpoint_")  # called during a run
RESULT_TYPES = {"grpo_components": ComponentSpec, "grpo_config_sections": ConfigSection}


def _checked(host: PluginHost, plugin: str, hook: str, result: Any) -> Any:
    """A registration hook's result, or None (and the plugin broken) when it is not a list of the right type."""
    kind = RESULT_TYPES.get(hook)
    if kind is None or result is None:
        return result
    items = list(result) if isinstance(result, (list, tuple)) else None
    wrong = [type(x).__name__ for x in items or () if not isinstance(x, kind)]
    if items is None or wrong:
        got = type(result).__name__ if items is None else ", ".join(sorted(set(wrong)))
        host._failed(plugin, hook, None, f"returned {got}, not a list of {kind.__name__}")
        return None
    if kind is ComponentSpec:
        host._origins.update({id(spec): plugin for spec in items})
    return items


def _guarded_call(host: PluginHost, plugin: str, hook: str, function: Any) -> Any:
    @functools.wraps(function)
    def guarded(*args: Any) -> Any:
        try:
            return _checked(host, plugin, hook, function(*args))
        except Exception as exc:  # noqa: BLE001 - any failure of a plugin is that plugin's problem
            host._failed(plugin, hook, exc)
            return None

    return guarded


def _guarded_wrapper(host: PluginHost, plugin: str, hook: str, function: Any) -> Any:
    """A ``wrapper=True`` (or old-style ``hookwrapper=True``) implementation, guarded: failing before its
    ``yield`` it becomes a pass-through; failing after it, the result is what it would have been without it."""

    @functools.wraps(function)
    def guarded(*args: Any) -> Any:
        try:
            inner = function(*args)
            value = next(inner)
        except Exception as exc:  # noqa: BLE001
            host._failed(plugin, hook, exc)
            return (yield)
        while True:  # forward what pluggy sends or throws until the wrapper finishes
            try:
                sent = yield value
            except BaseException as thrown:  # an implementation inside raised: the wrapper may handle it
                try:
                    value = inner.throw(thrown)
                except StopIteration as stop:
                    return stop.value
                except BaseException as exc:
                    if exc is thrown or not isinstance(exc, Exception):
                        raise  # the wrapper let the inner error through (or the process is stopping)
                    host._failed(plugin, hook, exc)
                    raise thrown from None  # as if this wrapper were not there
                continue
            try:
                value = inner.send(sent)
            except StopIteration as stop:
                return stop.value
            except Exception as exc:  # noqa: BLE001
                host._failed(plugin, hook, exc)
                return sent

    return guarded


def import_plugin_module(name: str) -> None:
    """``-p NAME``: import it, finding NAME.py in the current directory too, but after installed packages
    and only for this import (a ./tokenizers.py must not shadow the real one for the whole run)."""
    from grpo_sdk.core.errors import PluginError
    from grpo_sdk.core.imports import import_module_here_too

    try:
        import_module_here_too(name)
    except Exception as exc:  # noqa: BLE001 - whatever the module raises, the user asked for it by name
        raise PluginError(f"-p {name}: the hook plugin module could not be imported: {type(exc).__name__}: {exc}"
                          ) from exc
