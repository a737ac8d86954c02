"""Hook specifications: cross-cutting extensions carried by pluggy.

Components (backends, estimators, environments, ...) are found through entry-point groups and
selected by config. Hooks are for everything that is not "one component chosen by name":
observers of a run, extra `grpoctl` commands, extra config sections, in-process components.

A hook plugin is a module with ``@hookimpl`` functions, registered under the ``grpo_sdk.hooks``
entry-point group. Every hook is called with keyword arguments, so an implementation may accept
fewer arguments than the spec (pluggy's opt-in arguments): new arguments never break old plugins.

Example, ``acme_observer.py`` in a third-party package::

    from grpo_sdk.plugins import hookimpl

    @hookimpl
    def grpo_step_end(step, metrics):
        if metrics["reward/mean"] > 0.9:
            print(f"step {step}: reward above 0.9")

and in its ``pyproject.toml``::

    [project.entry-points."grpo_sdk.hooks"]
    acme-observer = "acme_observer"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import pluggy

if TYPE_CHECKING:
    import typer

    from grpo_sdk.plugins.specs import ComponentSpec, ConfigSection

PROJECT = "grpo_sdk"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def grpo_components() -> Iterable[ComponentSpec]:
    """Components registered in-process (merged with the entry-point groups).

    Use it for components that are not worth a distribution: a notebook's environment, or a
    family of environments generated from a list of datasets.
    """


@hookspec
def grpo_config_sections() -> Iterable[ConfigSection]:
    """Top-level config sections this plugin owns (e.g. ``acme_uploader:``).

    The section is structured into the named attrs class and reaches observers as
    ``run.config.extra_sections[name]``.
    """


@hookspec
def grpo_cli_commands(app: typer.Typer) -> None:
    """Add `grpoctl` subcommands: ``@app.command()`` or ``app.add_typer(...)``."""


@hookspec
def grpo_run_start(run: Any) -> None:
    """A run is about to take its first step. ``run`` has ``config``, ``run_dir``, ``registry`` and
    ``step`` (the step it resumes after; 0 for a fresh run)."""


@hookspec
def grpo_step_end(run: Any, step: int, metrics: dict[str, float]) -> None:
    """A training step finished; ``metrics`` are the logged scalars of that step."""


@hookspec
def grpo_checkpoint_saved(run: Any, step: int, path: str) -> None:
    """A complete checkpoint was written to ``path``."""


@hookspec
def grpo_run_end(run: Any, status: str, error: BaseException | None) -> None:
    """A run ended; ``status`` is a ``RunStatus`` (a ``str`` enum: ``"completed"``, ``"early_stop"``,
    ``"deadline"``, ``"interrupted"`` or ``"failed"``)."""
