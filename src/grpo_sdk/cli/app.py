"""`grpoctl`: the root Typer app and its entry point.

Nothing here imports torch: `grpoctl --help`, `plugins list` and `config validate` stay fast
and work where torch is broken. `run` and `doctor` import it when they need it.
"""

from __future__ import annotations

import sys
import traceback

import typer

from grpo_sdk.cli import config_cmd, doctor_cmd, export_cmd, plugins_cmd, report_cmd, run_cmd
from grpo_sdk.cli.common import EPILOG, STATE
from grpo_sdk.core.errors import ExitCode, GrpoSdkError
from grpo_sdk.trainer.signals import STOP, StopNow, exit_code_of

app = typer.Typer(
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `grpoctl` script: loads hook plugins, then runs the command."""
    # First thing: a stop signal from here on is honoured (immediately until a training loop is
    # ready to stop at a step boundary), including one that arrives while torch imports.
    STOP.reset()
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
    finally:
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
