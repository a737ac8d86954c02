"""Options of the megatron policy backend (``policy.megatron``); light: no torch, no megatron here.

Key names are the seed's ``policy.megatron_cfg`` names (design/megatron-config.md §1). The run-level
keys stay where they are and the megatron policy reuses them: ``policy.optimizer.*``,
``policy.scheduler.*``, ``policy.max_grad_norm``, ``policy.precision``.
"""

from __future__ import annotations

from typing import Literal

import attrs

from grpo_sdk.plugins import option

_positive = attrs.validators.gt(0)


@attrs.frozen(kw_only=True)
class MegatronPolicyConfig:
    tensor_model_parallel_size: int = option(
        1, "Tensor parallelism (TP): ranks that split the attention heads, MLP columns and vocabulary. "
        "Must divide num_attention_heads and num_key_value_heads.", validator=_positive)
    pipeline_model_parallel_size: int = option(
        1, "Pipeline parallelism (PP): stages the layers are split into; must divide num_hidden_layers.",
        validator=_positive)
    context_parallel_size: int = option(
        1, "Context parallelism (CP): ranks that split each sequence; needs CUDA (1 on CPU).", validator=_positive)
    expert_model_parallel_size: int = option(
        1, "Expert parallelism (EP) for mixture-of-experts models.", validator=_positive)
    sequence_parallel: bool = option(
        False, "Shard LayerNorm/dropout activations along the sequence over the TP group; needs "
        "tensor_model_parallel_size > 1.")
    activation_checkpointing: bool = option(
        False, "Recompute every layer's activations in backward (full recompute) to save memory.")
    use_distributed_optimizer: bool = option(
        False, "Shard the optimizer state over the data-parallel ranks (ZeRO-1); a no-op with one.")
    checkpoint_format: Literal["torch"] = option(
        "torch", "How checkpoints are saved: `torch` is each rank's model, optimizer, scheduler and RNG "
        "state with torch.save (an exact resume).")
    apply_rope_fusion: bool = option(
        False, "Fused RoPE kernel; needs CUDA (false on CPU).")
    bias_activation_fusion: bool = option(
        False, "Fused bias + activation (SwiGLU/GeLU) kernel; needs CUDA (false on CPU).")

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans: TP x PP x CP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
