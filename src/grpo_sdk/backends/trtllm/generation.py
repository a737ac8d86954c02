"""TensorRT-LLM generation, the spec's module (docs/trtllm.md): ``TrtllmGeneration(config, context)`` builds
``TrtllmEngineGeneration`` (engine.py: the LLM API in this process) or ``TrtllmServerGeneration``
(server.py: a trtllm-serve over HTTP) by ``policy.generation.trtllm.mode``. What both modes share is
base.py; importing the two modes here is what registers them with ``TrtllmGeneration``.
"""

from __future__ import annotations

from grpo_sdk.backends.trtllm.base import TrtllmGeneration
from grpo_sdk.backends.trtllm.engine import TrtllmEngineGeneration
from grpo_sdk.backends.trtllm.server import TrtllmServerGeneration

__all__ = ["TrtllmEngineGeneration", "TrtllmGeneration", "TrtllmServerGeneration"]
