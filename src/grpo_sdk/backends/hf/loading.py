"""Loading models and tokenizers with errors that name the path, and the shared forward pass."""

from __future__ import annotations

import torch

from grpo_sdk.plugins.tensors import process_logits, token_logprobs
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


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded prompt sees the positions it would alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float,
                      top_k: int | None, top_p: float, with_unfiltered: bool = False):
    """Input-aligned ``[B, S]`` logprobs of ``input_ids`` (column 0 is 0), in float32.

    With ``with_unfiltered``, also the logprobs without the top-k/top-p filter (temperature
    still applied), which the KL penalty uses: a filtered-out token has logprob -inf.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_for(attention_mask), use_cache=False).logits
    scaled = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    logprobs = torch.nn.functional.pad(token_logprobs(process_logits(scaled, 1.0, top_k, top_p), targets), (1, 0))
    if not with_unfiltered:
        return logprobs
    return logprobs, torch.nn.functional.pad(token_logprobs(scaled, targets), (1, 0))
