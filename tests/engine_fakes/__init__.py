"""FAKE engine modules for tests: each mirrors an engine's Python API surface; none runs an engine."""
