"""The built-in tiny model: a 2-layer GPT-2 and a character tokenizer, built locally.

``policy.model_name: builtin:tiny-gpt2`` makes the run write a real Hugging Face model
directory (config, safetensors, tokenizer) into ``<run_dir>/initial_model`` and train that,
so the built-in recipe exercises exactly the code path of a downloaded model, with no hub.

GPT-2's learned absolute positions matter at this size: a RoPE model of the same size fails to
learn digit reversal from random init (measured when the recipe was chosen).
"""

from __future__ import annotations

from pathlib import Path

from grpo_sdk.core.builtin_models import BUILTIN_MODELS, CHARACTERS, SPECIAL_TOKENS


def char_tokenizer_backend():
    """The character tokenizer as a ``tokenizers.Tokenizer``: no transformers (``config validate``
    tokenizes with it without importing transformers or torch)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return tok


def build_char_tokenizer():
    """A character-level tokenizer: one id per character, ``<bos>`` prepended on encode."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=char_tokenizer_backend(), bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


_TINY = BUILTIN_MODELS["tiny-gpt2"]


def build_tiny_gpt2(out_dir: str | Path, seed: int, *, n_embd: int = _TINY.n_embd, n_layer: int = _TINY.n_layer,
                    n_head: int = _TINY.n_head, n_positions: int = _TINY.n_positions) -> Path:
    """Write a randomly initialised GPT-2 and its tokenizer to ``out_dir``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_char_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=n_positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout would make prev and current logprobs differ
        activation_function="gelu_pytorch_tanh",  # GPT-2's gelu, fused: transformers' "gelu_new" is 4 Python ops
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _write(GPT2LMHeadModel, config, tokenizer, seed, out_dir)


def build_tiny_llama(out_dir: str | Path, seed: int) -> Path:
    """Write a randomly initialised Llama (``builtin:tiny-llama``) and the character tokenizer to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    facts = BUILTIN_MODELS["tiny-llama"]
    tokenizer = build_char_tokenizer()
    shape = facts.config_json()
    del shape["model_type"]
    config = LlamaConfig(**shape, attention_dropout=0.0, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return _write(LlamaForCausalLM, config, tokenizer, seed, out_dir)


def _write(model_class, config, tokenizer, seed: int, out_dir: str | Path) -> Path:
    """Initialise ``model_class(config)`` from ``seed`` (without touching the caller's RNG) and write it
    with the tokenizer to ``out_dir``."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


BUILDERS = {"tiny-gpt2": build_tiny_gpt2, "tiny-llama": build_tiny_llama}  # one for each name of core.builtin_models.BUILTIN_MODELS
