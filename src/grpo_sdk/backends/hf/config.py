"""Options of the hf backend (``policy.generation.hf`` and ``policy.hf``)."""

from __future__ import annotations

from typing import Literal

import attrs

from grpo_sdk.core.config import option


@attrs.frozen(kw_only=True)
class HFGenerationConfig:
    attn_implementation: Literal["sdpa", "eager"] | None = option(
        None, "Attention kernel passed to from_pretrained; null lets transformers choose.")


@attrs.frozen(kw_only=True)
class HFPolicyConfig:
    attn_implementation: Literal["sdpa", "eager"] | None = option(
        None, "Attention kernel passed to from_pretrained; null lets transformers choose.")
    gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory.")
