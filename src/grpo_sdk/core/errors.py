"""Errors and exit codes.

Every error grpo-sdk raises on purpose is a ``GrpoSdkError`` carrying the exit code `grpoctl`
uses for it, so the CLI maps errors to codes in one place and library users can catch one type.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Exit codes of `grpoctl`; part of the public API (scripts branch on them)."""

    OK = 0
    FAILED = 1  # a run failed at runtime (bad data, NaN loss, a backend crash)
    USAGE = 2  # bad flags or a bad config (Click's convention for usage errors)
    PLUGIN = 3  # a requested component is unknown, broken, missing requirements or incompatible
    ENVIRONMENT = 4  # a doctor check failed
    INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 + 2
    HANGUP = 129  # SIGHUP: the terminal closed
    TERMINATED = 143  # SIGTERM: a scheduler's preemption notice


class GrpoSdkError(Exception):
    """Base class; ``exit_code`` says how `grpoctl` ends when this escapes a command."""

    exit_code: ExitCode = ExitCode.FAILED


class ConfigError(GrpoSdkError):
    """One or more config problems, all reported at once.

    ``problems`` holds ``(path, message)`` pairs, e.g. ``("grpo.num_prompts_per_step",
    "expected an integer, got 3.9")``.
    """

    exit_code = ExitCode.USAGE

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        lines = [f"{path}: {msg}" if path else msg for path, msg in self.problems]
        noun = "problem" if len(lines) == 1 else "problems"
        super().__init__(f"{len(lines)} config {noun}:\n" + "\n".join("  " + ln for ln in lines))


class PluginError(GrpoSdkError):
    """A selected component cannot be used: unknown, broken, missing requirements, wrong API."""

    exit_code = ExitCode.PLUGIN


class DataError(GrpoSdkError):
    """Bad input data: a malformed row, a prompt that does not fit the context."""


class ModelLoadError(GrpoSdkError):
    """A model or tokenizer could not be loaded (missing directory, unreachable hub)."""


class ModelFileError(ModelLoadError):
    """A model file the config names cannot be used: not a GGUF file, truncated or corrupt, or an
    architecture or quantisation type transformers cannot read. Exit code 2: the config names a bad file."""

    exit_code = ExitCode.USAGE


class EnvironmentStepError(GrpoSdkError):
    """An environment raised or returned a non-finite reward for a named sample."""


class NonFiniteError(GrpoSdkError):
    """A loss or gradient was NaN or infinite; raised before the optimizer step."""
