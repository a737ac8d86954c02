"""`grpoctl plugins new NAME --kind KIND [--template T] [DIR]`: scaffold a plugin project (see grpo_sdk.cli.scaffold)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from grpo_sdk.cli.common import fail, get_registry, guarded
from grpo_sdk.core.errors import ExitCode
from grpo_sdk.plugins.registry import KIND_LABELS
from grpo_sdk.plugins.specs import KINDS


def new(name: str = typer.Argument(..., help="Plugin name, e.g. acme: the component acme in the distribution "
                                             "grpo-acme (package grpo_acme)."),
        directory: Optional[Path] = typer.Argument(None, help="Where to create the project (absent or empty); "
                                                              "default ./grpo-NAME."),
        kind: str = typer.Option(..., "--kind", help=f"One of: {', '.join(KINDS)}."),
        template: str = typer.Option("default", "--template",
                                     help="default: the kind's working example. server (--kind generation): a "
                                          "backend that talks HTTP to an inference server, with tests that start a "
                                          "small local one.")) -> None:
    """Create a plugin project: pyproject.toml with the entry point, a light spec with a config class, a
    working implementation of the kind's protocol, and tests that run grpo-sdk's contract kit."""
    def body() -> None:
        from grpo_sdk.cli.scaffold import cli_selection, load_template, plugin_names, render, write_project

        if kind not in KINDS:
            fail(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}", ExitCode.USAGE)
        try:
            load_template(kind, template)
        except ValueError as exc:
            fail(str(exc), ExitCode.USAGE)
        try:
            names = plugin_names(name)
        except ValueError as exc:
            fail(str(exc), ExitCode.USAGE)
        target = directory if directory is not None else Path(names.dist)
        try:
            written = write_project(target, render(names, kind, template=template))
        except FileExistsError as exc:
            fail(f"{exc}: refusing to overwrite it; pick another directory", ExitCode.USAGE)
        info = get_registry().info(kind, names.name)
        if info is not None:
            print(f"warning: an installed {KIND_LABELS[kind]} is already named {names.name!r} ({info.dist}): the two would "
                  "conflict once this one is installed; rename one of them", file=sys.stderr)
        print(f"Created {names.dist}, the {KIND_LABELS[kind]} {names.name!r}, in {target}:")
        for path in written:
            print(f"  {path.relative_to(target)}")
        print(f"\nNext:\n  cd {target}\n  pip install -e .\n  pytest      # grpo-sdk's contract tests\n  grpoctl run {cli_selection(kind, names.name)}")

    guarded(body)
