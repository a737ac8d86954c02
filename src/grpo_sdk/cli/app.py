"""`grpoctl`: the root Typer app and its entry point.

Nothing here imports torch: `grpoctl --help`, `plugins list` and `config validate` stay fast
and work where torch is broken. `run` and `doctor` import it when they need it.
"""

from __future__ import annotations

import contextlib
import difflib
import sys
import traceback
from typing import Any, Iterator

import typer
from typer.core import TyperGroup

from grpo_sdk.cli import config_cmd, doctor_cmd, export_cmd, plugins_cmd, report_cmd, run_cmd, serve_cmd
from grpo_sdk.cli.common import EPILOG, STATE
from grpo_sdk.core.errors import ExitCode, GrpoSdkError
from grpo_sdk.trainer.signals import STOP, StopNow, exit_code_of

# The click that typer runs on: its own vendored copy since typer 0.2x, the installed click before.
_CLICK_ERRORS = sys.modules[typer.BadParameter.__module__]


@contextlib.contextmanager
def _did_you_mean() -> Iterator[None]:
    """An unknown option says which one was meant: typer's parser lists the close matches as
    "(Possible options: --max-steps)", which reads as a list of everything allowed."""
    try:
        yield
    except _CLICK_ERRORS.NoSuchOption as exc:
        message, name = exc.message.rstrip("."), exc.option_name
        if "." in name and _takes_overrides(exc.ctx):  # `--grpo.max_num_steps=5`: a key, not a flag
            exc.message = f"{message}. Config overrides take no dashes: {name.lstrip('-')}=VALUE"
        elif exc.possibilities:
            exc.message = f"{message}. Did you mean {' or '.join(_closest(name, exc.possibilities))}?"
        exc.possibilities = None
        raise


def _closest(name: str, candidates: list[str]) -> list[str]:
    """The best of difflib's close matches (all of them when tied): `--kin` means --kind, not --plugin."""
    score = {c: difflib.SequenceMatcher(None, name, c).ratio() for c in candidates}
    best = max(score.values())
    return sorted(c for c in candidates if score[c] == best)


def _takes_overrides(ctx: Any) -> bool:
    return ctx is not None and any(param.name == "overrides" for param in ctx.command.params)


class RootGroup(TyperGroup):
    """`grpoctl`: every subcommand is parsed inside the root's ``invoke``, so a mistyped option of
    any command, plugin commands included, gets its did-you-mean here. Unknown commands already
    get one from typer (``suggest_commands``)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with _did_you_mean():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: Any) -> Any:
        with _did_you_mean():
            return super().invoke(ctx)


app = typer.Typer(
    cls=RootGroup,
    name="grpoctl",
    help="Train language models with GRPO-family RL; backends, estimators and environments are plugins.",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # tracebacks would print locals: tensors, prompts, API keys
    rich_markup_mode=None,
)


def _version_callback(value: bool) -> None:
    if value:
        from grpo_sdk import __version__

        print(f"grpo-sdk {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """grpoctl: GRPO post-training from the command line."""


app.command("run", epilog=EPILOG, no_args_is_help=False)(run_cmd.run)
app.add_typer(config_cmd.app, name="config")
app.add_typer(plugins_cmd.app, name="plugins")
app.command("doctor", epilog=EPILOG)(doctor_cmd.doctor)
app.command("report", epilog=EPILOG)(report_cmd.report)
app.command("export", epilog=EPILOG)(export_cmd.export)
app.command("serve", epilog=EPILOG)(serve_cmd.serve)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `grpoctl` script: loads hook plugins, then runs the command."""
    # First thing: a stop signal from here on is honoured (immediately until a training loop is
    # ready to stop at a step boundary), including one that arrives while torch imports.
    STOP.reset()
    try:
        try:
            STOP.install()
            return _run_app(argv)
        except SystemExit as exc:
            if STOP.stopped_now and exc.code != exit_code_of(STOP.signum):  # click turned a StopNow into Abort
                print("interrupted", file=sys.stderr)
                return exit_code_of(STOP.signum)
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt as exc:  # a stop signal outside a command body (start-up, plugin loading)
            print("interrupted", file=sys.stderr)
            return exit_code_of(exc.signum) if isinstance(exc, StopNow) else int(ExitCode.INTERRUPTED)
        except Exception:  # noqa: BLE001 - last resort: a bug, not a user error
            if STOP.stopped_now:  # a StopNow that C++ (torch, a callback) turned into another exception
                print("interrupted", file=sys.stderr)
                return exit_code_of(STOP.signum)
            traceback.print_exc()
            return int(ExitCode.FAILED)
    except StopNow as exc:  # a repeated signal while the first one's exit was being handled above
        return exit_code_of(exc.signum)
    finally:
        STOP.exiting = True  # first: a signal from here on finds the process already on its way out
        if STOP.requested:
            STOP.ignore_while_exiting()
        else:
            STOP.uninstall()


def _run_app(argv: list[str] | None) -> int:
    from grpo_sdk.plugins.host import PluginHost

    STATE.host, STATE.registry = PluginHost(), None
    try:
        STATE.host.load_entry_points()
    except GrpoSdkError as exc:  # only under GRPO_SDK_STRICT_PLUGINS
        print(f"error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    for plugin in STATE.host.plugins:
        if plugin.status != "ok":
            print(f"grpo-sdk: warning: hook plugin {plugin.name!r} failed to load: {plugin.problem}", file=sys.stderr)
    STATE.host.cli_commands(app)
    app(args=argv, standalone_mode=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
