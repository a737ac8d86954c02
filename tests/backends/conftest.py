"""Fixtures the backend tests share (tests/conftest.py has the ones every folder shares)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The hf sampler a stand-in engine server runs, on the tiny model in this process: what the
    server computes, seed for seed."""
    from engine_servers.base import EngineModel

    return EngineModel(str(tiny_model_dir))
