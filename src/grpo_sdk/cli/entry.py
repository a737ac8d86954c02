"""The `grpoctl` script's entry point: takes over the stop signals before anything else imports.

Importing the CLI (typer, rich, the plugin registry) takes ~0.2 s on a loaded machine; a scheduler's
SIGTERM in that window used to kill the process with -15. Here the handlers are installed first,
and a signal during the import exits with its own code (130/143/129), like one during a command.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from grpo_sdk.trainer.signals import STOP, StopNow, exit_code_of

    STOP.install()
    try:
        from grpo_sdk.cli.app import main as run_app
    except StopNow as stop:
        STOP.ignore_while_exiting()
        print("interrupted", file=sys.stderr)
        return exit_code_of(stop.signum)
    return run_app(argv)


if __name__ == "__main__":
    sys.exit(main())
