"""Options of the hf backend (``policy.generation.hf`` and ``policy.hf``)."""

from __future__ import annotations

from typing import Literal

import attrs

from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MAX_TOKENS


@attrs.frozen(kw_only=True)
class HFGenerationConfig:
    attn_implementation: Literal["sdpa", "eager"] | None = option(
        None, "Attention kernel passed to from_pretrained; null lets transformers choose.")
    compile: bool = option(False, "torch.compile the sampling forward with a static KV cache: about 1.5x faster "
                           "decoding of small models, after a one-time compilation of ~20 s per (batch, prompt "
                           "width) shape; needs a C++ compiler on CPU. Uses SDPA attention.")
    prompt_bucket: int = option(8, "With compile: prompts are left-padded to a multiple of this width, so few "
                                "shapes are compiled.", validator=[attrs.validators.gt(0), attrs.validators.le(MAX_TOKENS)])


@attrs.frozen(kw_only=True)
class HFPolicyConfig:
    attn_implementation: Literal["sdpa", "eager"] | None = option(
        None, "Attention kernel passed to from_pretrained; null lets transformers choose.")
    gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory.")
