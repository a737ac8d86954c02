"""The Megatron-Core lane: a Megatron-Core GPTModel built from a Hugging Face model directory through
verl's mbridge gives the Hugging Face model's logprobs, and exports its weights back in HF names.

These need megatron-core and mbridge, which live in their own virtual environment
(`.ci/megatron-venv`, run by `.ci/megatron-lane`); in the main environment they are skipped. On CPU
the model runs with the test-only shims in grpo_sdk.backends.megatron.cpu_shims.
"""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
        or importlib.util.find_spec("mbridge") is None,
        reason="needs megatron-core and mbridge (the megatron lane's venv: .ci/megatron-lane)",
    ),
]

VOCAB = 128
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mcore_world():
    """Gloo world of size 1, Megatron model parallel state (TP=1, PP=1) and the CPU shims."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from grpo_sdk.backends.megatron import cpu_shims

    undo = cpu_shims.apply() if not torch.cuda.is_available() else (lambda: None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0
    )
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        undo()


def _tiny_hf_dir(tmp_path, kind: str) -> str:
    import torch
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0,
        initializer_range=0.1,  # wider than the default 0.02, so the logprobs spread over several nats
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(1234)
    model = cls(config).to(torch.float32)
    # Random init leaves norms at 1 and Qwen2's qkv biases at 0: perturb every tensor so a swapped
    # or dropped weight shows in the comparison.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = tmp_path / kind
    model.save_pretrained(path)
    return str(path)


def _transformers5_compat(bridge) -> None:
    """mbridge 0.15.1 reads ``hf_config.rope_theta`` (mbridge/models/llama.py, qwen2.py
    ``_get_gptmodel_args``); transformers 5 keeps it in ``hf_config.rope_parameters["rope_theta"]``
    and the config object has no ``rope_theta`` attribute (AttributeError)."""
    cfg = bridge.hf_config
    if not hasattr(cfg, "rope_theta"):
        cfg.rope_theta = cfg.rope_parameters["rope_theta"]


def _next_token_logprobs(logits, ids):
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_mbridge_gptmodel_logprobs_equal_hf(mcore_world, tmp_path, kind):
    import torch
    import transformers
    from mbridge import AutoBridge

    from grpo_sdk.backends.megatron import cpu_shims

    hf_dir = _tiny_hf_dir(tmp_path, kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    bridge = AutoBridge.from_pretrained(hf_dir, dtype=torch.float32)
    _transformers5_compat(bridge)
    if not torch.cuda.is_available():
        cpu_shims.use_local_layer_spec(bridge)
    models = bridge.get_model(bf16=False, use_cpu_initialization=True, wrap_with_ddp=False)
    bridge.load_weights(models, hf_dir)
    (model,) = models
    model.eval()

    g = torch.Generator().manual_seed(7)
    batch, seq = 3, 24
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    with torch.no_grad():
        hf_logits = hf(input_ids=ids).logits
        # attention_mask=None: the local spec's DotProductAttention applies the causal mask itself.
        mc_logits = model(input_ids=ids, position_ids=position_ids, attention_mask=None)
    assert mc_logits.shape == hf_logits.shape, (mc_logits.shape, hf_logits.shape)
    hf_lp = _next_token_logprobs(hf_logits, ids)
    mc_lp = _next_token_logprobs(mc_logits, ids)
    diff = (hf_lp - mc_lp).abs().max().item()
    print(f"{kind}: max |logprob diff| = {diff:.3e}; logprob range {hf_lp.min().item():.3f}..{hf_lp.max().item():.3f}")
    assert diff <= TOL, diff

    # Export back through the bridge in Hugging Face names: the same names and values.
    hf_state = hf.state_dict()
    exported = {name: t.detach().cpu() for name, t in bridge.export_weights(models)}
    assert sorted(exported) == sorted(hf_state), (
        sorted(set(exported) ^ set(hf_state))
    )
    for name, t in hf_state.items():
        assert exported[name].dtype == t.dtype, name
        assert torch.equal(exported[name], t), name
