"""Loading models and tokenizers with errors that name the path (the forward pass is in ``forward``)."""

from __future__ import annotations

import torch

# Re-exported: the policy's forward pass lived here before it moved to its own module.
from grpo_sdk.backends.hf.forward import position_ids_for, sequence_logprobs  # noqa: F401
from grpo_sdk.plugins.toolkit import load_pretrained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(name: str, *, dtype: str, device: str, attn_implementation: str | None = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = load_pretrained(AutoModelForCausalLM.from_pretrained, name, "policy.model_name", **kwargs)
    # No dropout anywhere: eval mode keeps the logprobs of the sampler, of the old policy and of
    # the training forward pass identical for identical weights (gradients still flow).
    return model.to(device).eval()
