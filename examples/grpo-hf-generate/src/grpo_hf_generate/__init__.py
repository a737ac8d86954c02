"""An example third-party generation backend for grpo-sdk (see docs/plugins.md)."""
