"""Loading models and tokenizers with errors that name the path (the forward pass is in ``forward``)."""

from __future__ import annotations

import contextlib
import warnings

import torch

from grpo_sdk.plugins.tensors import DTYPES
from grpo_sdk.plugins.toolkit import load_pretrained


def load_model(name: str, *, dtype: str, device: str, attn_implementation: str | None = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = load_pretrained(AutoModelForCausalLM.from_pretrained, name, "policy.model_name", **kwargs)
    # No dropout anywhere: eval mode keeps the logprobs of the sampler, of the old policy and of
    # the training forward pass identical for identical weights (gradients still flow).
    return model.to(device).eval()


def autocast_context(device: torch.device | str, dtype: str | None):
    """A factory of the mixed-precision context of ``policy.hf.autocast`` (a no-op context without it).
    Only the model's forward runs under it; the backward replays the dtypes the forward recorded."""
    if dtype is None:
        return contextlib.nullcontext
    device_type, low = torch.device(device).type, DTYPES[dtype]
    return lambda: torch.autocast(device_type=device_type, dtype=low)


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer in backward. transformers checkpoints a layer only while it is in
    training mode, and the policy runs in eval mode (no dropout): so the decoder layers themselves,
    not their submodules (whose dropout stays off), are flagged as training. Their forward still
    skips checkpointing without gradients (logprobs, sampling), where it would only cost time."""
    # transformers 5.x renamed it; 4.x has only the old name.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: the flag lives on the base model, which would also drop the KV cache
        warnings.warn("policy.hf.gradient_checkpointing: this transformers has no GradientCheckpointingLayer; "
                      "checkpointing acts only in training mode, which the policy does not use", RuntimeWarning)
        return
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True  # this module only: .train() would turn on its submodules' dropout

