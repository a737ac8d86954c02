"""Options of the megatron policy backend (``policy.megatron``); light: no torch, no megatron here.

Key names are NeMo-RL's ``policy.megatron_cfg`` names (design/megatron-config.md §1). The run-level
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
        "torch", "How checkpoints are saved: `torch` is the model as a Hugging Face directory (mbridge's "
        "export) plus each tensor-parallel shard's optimizer, scheduler and RNG state with torch.save (an "
        "exact resume).")
    apply_rope_fusion: bool = option(
        False, "Fused RoPE kernel; needs CUDA (false on CPU).")
    bias_activation_fusion: bool = option(
        False, "Fused bias + activation (SwiGLU/GeLU) kernel; needs CUDA (false on CPU).")

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans: TP x PP x CP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


# What the megatron policy does not run yet, with why: refused by the config check (the spec) before a
# run starts and by the policy itself when built directly. Keys of MegatronPolicyConfig.
NOT_BUILT = {
    "pipeline_model_parallel_size": "pipeline stages exchange activations point to point and need "
    "Megatron's forward_backward_func schedule, which this policy does not drive (it runs each "
    "micro-batch's forward and backward itself)",
    "context_parallel_size": "context parallelism splits every sequence over ranks, and this policy's "
    "logprobs roll each row by its own padding and need the whole row on one rank",
    "expert_model_parallel_size": "expert weights would need their gradients reduced over the "
    "expert-data-parallel group, which this policy does not do (it reduces over the data-parallel group)",
    "sequence_parallel": "the norms' gradients would need the tensor-parallel all-reduce of Megatron's "
    "finalize_model_grads, and Megatron's local layer spec (no Transformer Engine) refuses it "
    "(megatron/core/transformer/torch_norm.py:32)",
    "use_distributed_optimizer": "with more than one data-parallel replica each keeps its own torch AdamW "
    "state; Megatron's distributed optimizer is not wired in",
}
