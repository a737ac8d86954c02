"""The built-in tiny model: a 2-layer GPT-2 and a character tokenizer, built locally.

``policy.model_name: builtin:tiny-gpt2`` makes the run write a real Hugging Face model
directory (config, safetensors, tokenizer) into ``<run_dir>/initial_model`` and train that,
so the built-in recipe exercises exactly the code path of a downloaded model, with no hub.

GPT-2's learned absolute positions matter at this size: a RoPE model of the same size fails to
learn digit reversal from random init (see shared/research/tiny-grpo-prototype.md).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789abcdefgh+=>")


def build_char_tokenizer():
    """A character-level tokenizer: one id per character, ``<bos>`` prepended on encode."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def build_tiny_gpt2(out_dir: str | Path, seed: int, *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                    n_positions: int = 64) -> Path:
    """Write a randomly initialised GPT-2 and its tokenizer to ``out_dir``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_char_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=n_positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout would make prev and current logprobs differ
        activation_function="gelu_pytorch_tanh",  # GPT-2's gelu, fused: transformers' "gelu_new" is 4 Python ops
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


BUILTIN_MODELS = {"tiny-gpt2": build_tiny_gpt2}


def resolve_model_path(model_name: str, run_dir: str | Path, seed: int) -> str:
    """``builtin:NAME`` -> a freshly built local directory; anything else is returned unchanged."""
    if not model_name.startswith("builtin:"):
        return model_name
    name = model_name.split(":", 1)[1]
    if name not in BUILTIN_MODELS:
        from grpo_sdk.core.errors import ConfigError

        raise ConfigError([("policy.model_name", f"unknown built-in model {name!r}; "
                                                 f"built-ins: {', '.join(sorted(BUILTIN_MODELS))}")])
    out = Path(run_dir) / "initial_model"
    if not out.is_dir():  # built aside, then renamed: a kill mid-write never leaves half a model behind
        import shutil

        from grpo_sdk.core.checkpoint import fsync_tree
        from grpo_sdk.core.run_dir import replace_dir

        staging = Path(run_dir) / ".initial_model.partial"
        shutil.rmtree(staging, ignore_errors=True)
        BUILTIN_MODELS[name](staging, seed)
        fsync_tree(staging)
        replace_dir(staging, out)
    return str(out)
