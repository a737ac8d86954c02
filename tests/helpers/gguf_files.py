"""Tiny GGUF files written here with the gguf package's GGUFWriter, for tests that need no download.

``write_tiny_llama`` writes a 2-layer Llama (hidden 32, 4 heads, 2 KV heads, a byte-level BPE
tokenizer of 256 bytes + 2 merges + 3 specials, a ChatML chat template) with random weights: the norms in F32,
everything else in ``quant`` (Q8_0 by default; F32 too). transformers' GGUF loader reads it as it
reads a llama.cpp export. What it does not prove: that a file llama.cpp wrote loads (the real-wheel
tests in tests/e2e/test_gguf_real.py do), nor anything about the quality of the model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 64, 2
MERGES = ("Ġ t", "h e")  # the two merged tokens follow the 256 bytes in the vocabulary
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = 256 + len(MERGES) + len(SPECIALS)
BOS, EOS = 256 + len(MERGES), 256 + len(MERGES) + 2
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: each byte as the one character its byte-level BPE uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_llama_tensors(seed: int = 0, vocab: int = VOCAB, tied: bool = True) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 weight in Hugging Face's (out, in) layout."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"token_embd.weight": w(vocab, HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32)}
    if not tied:
        tensors["output.weight"] = w(vocab, HIDDEN)
    for i in range(LAYERS):
        tensors.update({
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.attn_q.weight": w(HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_k.weight": w(KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": w(KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * head_dim),
            f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": w(HIDDEN, FFN),
        })
    return tensors


def write_tiny_llama(path: Path, *, quant: str = "Q8_0", arch: str = "llama", seed: int = 0, tied: bool = True,
                     raw_type: str | None = None) -> Path:
    """Write the tiny Llama to ``path``. ``arch`` other than llama writes the same tensors under that
    architecture name (for the unsupported-architecture error); ``raw_type`` stores the weight matrices
    as bytes declared to be that GGML type (for the unsupported-quantisation error)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES] + list(SPECIALS)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama-test")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (256 + len(MERGES)) + [3] * len(SPECIALS))  # normal, then control
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(EOS)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, weight in tiny_llama_tensors(seed, len(tokens), tied).items():
        if weight.ndim == 1 or quant == "F32" and raw_type is None:
            writer.add_tensor(name, weight)
        elif raw_type is not None:
            block, size = gguf.GGML_QUANT_SIZES[Q[raw_type]]
            rows = np.zeros((weight.shape[0], weight.shape[1] // block * size), dtype=np.uint8)  # declared, not read
            writer.add_tensor(name, rows, raw_dtype=Q[raw_type])
        else:
            writer.add_tensor(name, gguf.quants.quantize(weight, Q[quant]), raw_dtype=Q[quant])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
