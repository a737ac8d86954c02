"""The pluggy host: loads hook plugins one by one and calls hooks through typed methods.

Each hook module is loaded behind its own try/except, so one broken plugin is recorded and
reported instead of breaking every command (the llm #1280 and conda lessons). Observer hooks
that raise during a run are reported and do not stop training: an uploader must not kill a
12-hour run.
"""

from __future__ import annotations

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
        self.plugins.append(HookPluginInfo(name=name, status="ok", hooks=self._hook_names(plugin), **info))

    def _hook_names(self, plugin: object) -> tuple[str, ...]:
        return tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()))

    # Typed facade: the only callers of pm.hook, so hook arguments are checked in one place.

    def components(self) -> list[tuple[str, ComponentSpec]]:
        """(plugin name, spec) for every component registered through ``grpo_components``."""
        found = []
        for impl in self.pm.hook.grpo_components.get_hookimpls():
            for spec in impl.function() or ():
                found.append((impl.plugin_name, spec))
        return found

    def config_sections(self) -> list[ConfigSection]:
        return [s for result in self.pm.hook.grpo_config_sections() for s in (result or ())]

    def cli_commands(self, app: Any) -> None:
        for impl in self.pm.hook.grpo_cli_commands.get_hookimpls():
            try:
                impl.function(app=app)
            except Exception as exc:  # noqa: BLE001
                print(f"grpo-sdk: plugin {impl.plugin_name!r} failed to add commands: "
                      f"{describe_exception(exc)}", file=sys.stderr)

    def notify(self, hook: str, **kwargs: Any) -> None:
        """Call an observer hook; a failing observer is reported, never fatal."""
        caller = getattr(self.pm.hook, hook)
        for impl in caller.get_hookimpls():
            try:
                impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
            except Exception as exc:  # noqa: BLE001
                if strict_plugins():
                    raise
                print(f"grpo-sdk: hook {hook} of plugin {impl.plugin_name!r} raised "
                      f"{describe_exception(exc)}", file=sys.stderr)

    def run_start(self, run: Any) -> None:
        self.notify("grpo_run_start", run=run)

    def step_end(self, run: Any, step: int, metrics: dict[str, float]) -> None:
        self.notify("grpo_step_end", run=run, step=step, metrics=metrics)

    def checkpoint_saved(self, run: Any, step: int, path: str) -> None:
        self.notify("grpo_checkpoint_saved", run=run, step=step, path=path)

    def run_end(self, run: Any, status: str, error: BaseException | None) -> None:
        self.notify("grpo_run_end", run=run, status=status, error=error)
