"""Preparing an mbridge bridge for the machine it builds on: what the installed stack lacks, decided by
what is importable rather than by "CPU or GPU" (a GPU box may lack Transformer Engine or Apex too).

Used by the megatron policy and the megatron generation before ``bridge.get_model``.
"""

from __future__ import annotations

import importlib.util
from typing import Any


def transformers5_compat(bridge: Any) -> None:
    """mbridge 0.15.1 reads ``hf_config.rope_theta`` (mbridge/models/llama.py, qwen2.py
    ``_get_gptmodel_args``); transformers 5 keeps it in ``hf_config.rope_parameters["rope_theta"]``
    and the config object has no ``rope_theta`` attribute (AttributeError)."""
    cfg = bridge.hf_config
    if not hasattr(cfg, "rope_theta"):
        params = getattr(cfg, "rope_parameters", None) or {}
        if "rope_theta" in params:
            cfg.rope_theta = params["rope_theta"]


def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def has_fused_softmax_kernel() -> bool:
    """Megatron's fused masked softmax imports this Apex / Megatron CUDA extension when it runs."""
    return importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def megatron_core_019_compat() -> bool:
    """mbridge 0.15.1's ``get_model`` (mbridge/core/util.py:52,83) compares with
    ``ModelType.encoder_and_decoder``, which megatron-core 0.19 removed (AttributeError at model build).
    Gives mbridge's module a ModelType that has it (never equal to a real model type, as intended: only
    decoder models are built here). Returns whether it patched. Found by benchmarks/gpu/check_megatron.py
    --tiny against megatron-core 0.19.2 on CPU (design/megatron-gpu.md)."""
    import types

    from megatron.core.enums import ModelType

    if hasattr(ModelType, "encoder_and_decoder"):
        return False
    import mbridge.core.util as mbridge_util

    if not isinstance(mbridge_util.ModelType, types.SimpleNamespace):
        mbridge_util.ModelType = types.SimpleNamespace(encoder_or_decoder=ModelType.encoder_or_decoder,
                                                       encoder_and_decoder=object())
    return True


def adapt_bridge(bridge: Any) -> Any:
    """Everything a bridge needs before ``get_model`` on this machine. Returns the bridge.

    * transformers 5's config layout (:func:`transformers5_compat`);
    * megatron-core >= 0.19 under mbridge 0.15.1 (:func:`megatron_core_019_compat`);
    * without Transformer Engine, Megatron-Core's local layer spec (mbridge assumes TE:
      ``cpu_shims.use_local_layer_spec`` says why and how);
    * without the fused-softmax CUDA extension, ``masked_softmax_fusion`` off: mbridge turns it on, and
      the fused path raises ModuleNotFoundError('scaled_masked_softmax_cuda') at the first bf16/fp16
      forward (found by benchmarks/gpu/check_megatron.py --tiny on CPU).
    """
    transformers5_compat(bridge)
    megatron_core_019_compat()
    if not has_transformer_engine():
        from grpo_sdk.backends.megatron.cpu_shims import use_local_layer_spec

        use_local_layer_spec(bridge)
    if not has_fused_softmax_kernel():
        bridge.config.masked_softmax_fusion = False
    return bridge
