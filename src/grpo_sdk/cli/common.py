"""Shared state of one `grpoctl` invocation and the error-to-exit-code mapping."""

from __future__ import annotations

import sys
from typing import Any, Callable

import typer

from grpo_sdk.core.errors import ExitCode, GrpoSdkError
from grpo_sdk.trainer.signals import StopNow, exit_code_of

EPILOG = ("Exit codes: 0 ok, 1 run failed, 2 usage or config error, 3 plugin error, "
          "4 doctor check failed, 130 interrupted (SIGINT), 143 terminated (SIGTERM), 129 hung up (SIGHUP).")


class _State:
    host: Any = None
    registry: Any = None


STATE = _State()


def get_registry():
    """The registry of this invocation, discovered on first use with the already-loaded hooks."""
    from grpo_sdk.plugins.host import PluginHost
    from grpo_sdk.plugins.registry import Registry

    if STATE.host is None:  # commands called without main() (tests, embedding)
        STATE.host = PluginHost()
        STATE.host.load_entry_points()
    if STATE.registry is None:
        STATE.registry = Registry.discover(host=STATE.host)
        for info in STATE.registry.problems():
            print(f"grpo-sdk: warning: {info.kind} {info.name!r} ({info.dist}): {info.status}: {info.problem}",
                  file=sys.stderr)
    return STATE.registry


def fail(message: str, code: ExitCode) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(int(code))


def guarded(fn: Callable[[], Any]) -> Any:
    """Run a command body, mapping grpo-sdk errors and Ctrl-C to their exit codes."""
    try:
        return fn()
    except GrpoSdkError as exc:
        fail(str(exc), exc.exit_code)
    except MemoryError:
        fail("out of memory. A step holds grpo.num_prompts_per_step x grpo.num_generations_per_prompt sequences of "
             "up to policy.max_total_sequence_length tokens (and validation grpo.val_batch_size of them): lower "
             "those, or policy.train_micro_batch_size, or run on a machine with more memory.", ExitCode.FAILED)
    except KeyboardInterrupt as exc:  # StopNow carries the signal: exit 128 + its number
        print("interrupted", file=sys.stderr)
        raise typer.Exit(exit_code_of(exc.signum) if isinstance(exc, StopNow) else int(ExitCode.INTERRUPTED))


def load_plugin_modules(modules: list[str]):
    """``-p MODULE ...``: import each as a hook plugin; the registry of this invocation, rediscovered when
    any was given (the new modules may register components or config sections)."""
    from grpo_sdk.plugins.host import import_plugin_module

    registry = get_registry()
    for module in modules:
        import_plugin_module(module)
        STATE.host.load_module(module)
    if modules:
        from grpo_sdk.plugins.registry import Registry

        registry = STATE.registry = Registry.discover(host=STATE.host)
    return registry
