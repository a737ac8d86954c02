"""Entry-point targets of the built-in loggers."""

from grpo_sdk.plugins import ComponentSpec

JSONL = ComponentSpec(
    name="jsonl",
    kind="logger",
    impl="grpo_sdk.loggers.jsonl:JSONLLogger",
    summary="One JSON object per step in <run_dir>/metrics.jsonl.",
)

CONSOLE = ComponentSpec(
    name="console",
    kind="logger",
    impl="grpo_sdk.loggers.console:ConsoleLogger",
    summary="Every metric of every step on stdout (verbose; for debugging).",
)
