"""`grpoctl`: the root Typer app and its entry point.

Nothing here imports torch: `grpoctl --help`, `plugins list` and `config validate` stay fast
and work where torch is broken. `run` and `doctor` import it when they need it.

The built-in subcommands are imported only when one is run or its help is shown: `grpoctl --help`
lists them from ``BUILTINS`` (their names and first help paragraphs), which saves importing the
config schema and every command module at each start-up (docs/benchmarks.md, "CLI start-up").
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import sys
import traceback
from collections.abc import MutableMapping
from typing import Any, Iterator, NamedTuple

import typer
from typer.core import TyperGroup

from grpo_sdk.cli.common import EPILOG, STATE
from grpo_sdk.core.errors import ExitCode, GrpoSdkError
from grpo_sdk.trainer.signals import STOP, StopNow, exit_code_of

# The click that typer runs on: its own vendored copy since typer 0.2x, the installed click before.
_CLICK_ERRORS = sys.modules[typer.BadParameter.__module__]
_CLICK_UTILS = importlib.import_module(_CLICK_ERRORS.__name__.rpartition(".")[0] + ".utils")


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


class Builtin(NamedTuple):
    """A built-in subcommand: where it lives, and what `grpoctl --help` says of it without importing it."""

    module: str
    attr: str  # a command function, or a Typer app for a group
    summary: str  # the first paragraph of its help; tests/unit/test_cli_usage.py checks it against the real one
    group: bool = False
    options: dict[str, Any] = {}


# In `grpoctl --help` order: commands, then groups (plugin commands go between them, as typer
# orders commands registered on `app` before its groups).
BUILTINS = {
    "run": Builtin("grpo_sdk.cli.run_cmd", "run", "Train with GRPO. Writes config, plugin versions, metrics.jsonl "
                   "and checkpoints to the run dir.", options={"no_args_is_help": False}),
    "doctor": Builtin("grpo_sdk.cli.doctor_cmd", "doctor", "Versions, interpreter, devices and per-plugin status; "
                      "exit 4 if something is broken."),
    "report": Builtin("grpo_sdk.cli.report_cmd", "report", "Plot reward, KL, response length, timing, validation "
                      "and an async run's pipeline; write report.md."),
    "export": Builtin("grpo_sdk.cli.export_cmd", "export", "Copy a checkpoint's policy (config, safetensors, "
                      "tokenizer) to OUT, ready for from_pretrained or vLLM."),
    "serve": Builtin("grpo_sdk.cli.serve_cmd", "serve", "Serve MODEL behind an OpenAI-compatible endpoint (chat, "
                     "completions, responses, tokenize) until SIGINT or SIGTERM, then exit 0."),
    "config": Builtin("grpo_sdk.cli.config_cmd", "app", "Show, validate and document run configs.", group=True),
    "plugins": Builtin("grpo_sdk.cli.plugins_cmd", "app", "List and inspect plugins: backends, estimators, "
                       "environments, transports, loggers, hooks.", group=True),
}


def load_builtin(name: str) -> Any:
    """The click command of built-in subcommand ``name``, built exactly as ``app.command`` /
    ``app.add_typer`` on the root would build it."""
    spec = BUILTINS[name]
    target = getattr(importlib.import_module(spec.module), spec.attr)
    holder = typer.Typer(rich_markup_mode=None, pretty_exceptions_enable=False, add_completion=False)
    holder.callback()(lambda: None)  # a callback: typer builds a group even around one command
    if spec.group:
        holder.add_typer(target, name=name)
    else:
        holder.command(name, epilog=EPILOG, **spec.options)(target)
    return typer.main.get_command(holder).commands[name]


class LazyCommands(MutableMapping):
    """The root's subcommands by name, in help order; a built-in one is imported on first access.
    Plain iteration (names, `in`) imports nothing; ``peek`` tells whether one is loaded yet."""

    def __init__(self, registered: dict[str, Any]) -> None:
        def is_group(command: Any) -> bool:
            return hasattr(command, "commands")

        commands = [n for n in BUILTINS if not BUILTINS[n].group]
        groups = [n for n in BUILTINS if BUILTINS[n].group]
        # a plugin's command of a built-in's name replaces it, in the built-in's place (as a dict would)
        order = ([*commands, *(n for n, c in registered.items() if not is_group(c) and n not in BUILTINS), *groups,
                  *(n for n, c in registered.items() if is_group(c) and n not in BUILTINS)])
        self._items: dict[str, Any] = {name: registered.get(name, BUILTINS.get(name)) for name in order}

    def peek(self, name: str) -> Any:
        """The command, or its ``Builtin`` when it is not imported yet."""
        return self._items[name]

    def __getitem__(self, name: str) -> Any:
        value = self._items[name]
        if isinstance(value, Builtin):
            value = self._items[name] = load_builtin(name)
        return value

    def __setitem__(self, name: str, command: Any) -> None:
        self._items[name] = command

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class RootGroup(TyperGroup):
    """`grpoctl`: every subcommand is parsed inside the root's ``invoke``, so a mistyped option of
    any command, plugin commands included, gets its did-you-mean here. Unknown commands already
    get one from typer (``suggest_commands``). The built-in subcommands load lazily (``LazyCommands``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = LazyCommands(dict(self.commands))

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)  # typer's reads every value, which would import every command

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """typer's listing, with a built-in that is not imported yet summarised from ``BUILTINS``."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.commands.peek(name)
            if not isinstance(command, Builtin) and command.hidden:
                continue
            rows.append((name, command))
        if not rows:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in rows)
        lines = [(name, _CLICK_UTILS.make_default_short_help(command.summary, limit) if isinstance(command, Builtin)
                  else command.get_short_help_str(limit)) for name, command in rows]
        with formatter.section("Commands"):
            formatter.write_dl(lines)

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


# grpo_sdk.plugins.specs.HOOKS_GROUP, spelled out: importing grpo_sdk.plugins builds the config
# schema (~30 ms), which `grpoctl --help` needs only when a hook plugin is installed
# (tests/unit/test_cli_usage.py checks the two agree).
HOOKS_GROUP = "grpo_sdk.hooks"


def _run_app(argv: list[str] | None) -> int:
    import importlib.metadata as md

    STATE.host, STATE.registry = None, None  # get_registry() makes the host when a command needs it
    if md.entry_points(group=HOOKS_GROUP):  # hook plugins may add commands: load them before parsing
        _load_hook_plugins()
    app(args=argv, standalone_mode=True)
    return 0


def _load_hook_plugins() -> None:
    from grpo_sdk.plugins.host import PluginHost

    STATE.host = PluginHost()
    try:
        STATE.host.load_entry_points()
    except GrpoSdkError as exc:  # only under GRPO_SDK_STRICT_PLUGINS
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(int(exc.exit_code)) from None
    for plugin in STATE.host.plugins:
        if plugin.status != "ok":
            print(f"grpo-sdk: warning: hook plugin {plugin.name!r} failed to load: {plugin.problem}", file=sys.stderr)
    STATE.host.cli_commands(app)


if __name__ == "__main__":
    sys.exit(main())
