"""Metric sinks (the ``grpo_sdk.loggers`` group)."""
