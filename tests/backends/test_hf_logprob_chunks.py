"""The hf policy's forward pass computes logits only at response positions, in chunks (issue 20, item 1).

Checked against the full forward pass it replaced (every position's logits at once): the same
logprobs and gradients, zeros where nothing is scored, chunks no larger than asked, the head
never fed a position whose target is not a response token, architectures that transform the
logits after the head (softcapping; an unknown transform falls back), and the config key.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import config_problems

from grpo_sdk.backends.hf import forward
from grpo_sdk.backends.hf.forward import default_chunk_size, position_ids_for, sequence_logprobs
from grpo_sdk.backends.hf.loading import load_model
from grpo_sdk.plugins.tensors import process_logits, token_logprobs

SAMPLING = dict(temperature=0.7, top_k=6, top_p=0.9)


def full_forward(model, ids, mask, *, temperature, top_k, top_p):
    """The previous implementation: every position's float32 logits at once."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=False).logits
    scaled = logits[:, :-1].float() / temperature
    targets = ids[:, 1:]
    pad = torch.nn.functional.pad
    return (pad(token_logprobs(process_logits(scaled, 1.0, top_k, top_p), targets), (1, 0)),
            pad(token_logprobs(scaled, targets), (1, 0)))


def rows(vocab: int = 25, seed: int = 0):
    """Left-padded prompts, right-padded ragged responses (token_mask 1 on the responses)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (4, 14), generator=g)
    mask = torch.ones(4, 14, dtype=torch.long)
    token_mask = torch.zeros(4, 14)
    prompt_pad, response = [0, 2, 4, 1], [6, 3, 8, 0]  # the last row has an empty response
    for i in range(4):
        mask[i, :prompt_pad[i]] = 0
        mask[i, 6 + response[i]:] = 0
        token_mask[i, 6:6 + response[i]] = 1
    return ids, mask, token_mask


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2, build_tiny_llama

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("chunks")
    return {"gpt2": load_model(str(build_tiny_gpt2(root / "gpt2", seed=0)), dtype="float32", device="cpu"),
            "llama": load_model(str(build_tiny_llama(root / "llama", seed=0)), dtype="float32", device="cpu")}


def same_where_scored(actual, expected, token_mask):
    scored = torch.nn.functional.pad(token_mask[:, 1:], (1, 0)) > 0
    both_inf = torch.isinf(expected) & torch.isinf(actual)  # a token top-k/top-p filtered out: -inf in both
    assert torch.equal(torch.isinf(expected[scored]), torch.isinf(actual[scored]))
    torch.testing.assert_close(actual[scored & ~both_inf], expected[scored & ~both_inf], rtol=0, atol=1e-5)
    assert torch.equal(actual[~scored], torch.zeros_like(actual[~scored]))  # nothing computed there


@pytest.mark.parametrize("name", ["gpt2", "llama"])  # tied and untied embeddings
@pytest.mark.parametrize("chunk", [None, 1, 4])
def test_logprobs_and_gradients_equal_the_full_forward_pass(models, name, chunk):
    model = models[name]
    ids, mask, token_mask = rows()
    expected, expected_unfiltered = full_forward(model, ids, mask, **SAMPLING)
    actual, actual_unfiltered = sequence_logprobs(model, ids, mask, **SAMPLING, with_unfiltered=True,
                                                  token_mask=token_mask, chunk_size=chunk)
    same_where_scored(actual, expected, token_mask)
    same_where_scored(actual_unfiltered, expected_unfiltered, token_mask)
    assert torch.isinf(expected[token_mask > 0]).any()  # the filter did filter a sampled token

    # Gradients of a loss on the scored positions (filtered-out tokens excluded, as the loss's mask would).
    weight = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * token_mask
    def grads(logprobs, unfiltered):
        model.zero_grad(set_to_none=True)
        finite = torch.isfinite(logprobs)
        (torch.where(finite, logprobs, 0) * weight).sum().backward(retain_graph=False)
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    want = grads(*full_forward(model, ids, mask, **SAMPLING))
    got = grads(*sequence_logprobs(model, ids, mask, **SAMPLING, with_unfiltered=True, token_mask=token_mask,
                                   chunk_size=chunk))
    assert any(g.abs().sum() > 0 for g in want.values())
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_the_head_sees_only_response_positions_in_bounded_chunks(models, monkeypatch):
    model = copy.deepcopy(models["llama"])
    ids, mask, token_mask = rows()
    sequence_logprobs(model, ids, mask, **SAMPLING, token_mask=token_mask)  # the one-time probe happens here
    head = model.get_output_embeddings()
    original, seen = head.forward, []

    def recording(hidden):
        seen.append(tuple(hidden.shape))
        return original(hidden)

    head.forward = recording
    sequence_logprobs(model, ids, mask, **SAMPLING, token_mask=token_mask, chunk_size=5)
    scored = int(token_mask[:, 1:].sum())  # 6 + 3 + 8 + 0 targets, minus none: the responses start at column 6
    assert scored == 17
    assert [rows for rows, _ in seen] == [5, 5, 5, 2]  # never the prompt, the padding or the last position
    assert head.forward is recording  # an instance-level forward is put back after the call
    # The default (null) chunk: as many positions as fit LOGITS_CHUNK_BYTES of float32 logits.
    seen.clear()
    vocab = model.config.vocab_size
    monkeypatch.setattr(forward, "LOGITS_CHUNK_BYTES", 4 * vocab * 6 + 3)
    sequence_logprobs(model, ids, mask, **SAMPLING, token_mask=token_mask)
    assert [rows for rows, _ in seen] == [6, 6, 5]
    monkeypatch.undo()
    # Without a token mask every position but the last is scored, as before.
    seen.clear()
    sequence_logprobs(model, ids, mask, **SAMPLING, chunk_size=100)
    assert seen == [(4 * 13, model.config.hidden_size)]


def test_a_micro_batch_with_nothing_to_score_still_gives_every_parameter_a_gradient(models):
    model = models["gpt2"]
    ids, mask, _ = rows()
    logprobs = sequence_logprobs(model, ids, mask, **SAMPLING, token_mask=torch.zeros(ids.shape))
    assert torch.equal(logprobs, torch.zeros(ids.shape))
    model.zero_grad(set_to_none=True)
    logprobs.sum().backward()  # FSDP reduce-scatters every parameter's gradient: none may be missing
    assert all(p.grad is not None and torch.equal(p.grad, torch.zeros_like(p.grad)) for p in model.parameters())


def test_default_chunk_bounds_the_float32_logits():
    assert default_chunk_size(151_936) == 110 and 110 * 151_936 * 4 <= forward.LOGITS_CHUNK_BYTES
    assert default_chunk_size(25) == forward.LOGITS_CHUNK_BYTES // 100
    assert default_chunk_size(2**40) == 1


def tiny_gemma2(softcap: float):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                          final_logit_softcapping=softcap, attn_implementation="eager")
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


def test_logit_softcapping_is_applied_after_the_head():
    model = tiny_gemma2(softcap=0.5)  # small enough that tanh changes every logit
    ids, mask, token_mask = rows(vocab=40)
    plain = dict(temperature=1.0, top_k=None, top_p=1.0)
    expected, _ = full_forward(model, ids, mask, **plain)
    actual = sequence_logprobs(model, ids, mask, **plain, token_mask=token_mask, chunk_size=3)
    assert forward._HEAD_EXACT[model] is True
    same_where_scored(actual, expected, token_mask)


class ScaledLogits(torch.nn.Module):
    """A causal LM that multiplies its logits by 3 after the head: a transform the policy does not know."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 3
        return out


def test_an_unknown_logits_transform_falls_back_to_the_full_forward_pass(models, caplog):
    model = ScaledLogits(models["gpt2"])
    ids, mask, token_mask = rows()
    expected, _ = full_forward(model, ids, mask, **SAMPLING)
    with caplog.at_level("WARNING"):
        actual = sequence_logprobs(model, ids, mask, **SAMPLING, token_mask=token_mask, chunk_size=2)
    assert forward._HEAD_EXACT[model] is False
    assert "not the model's own logits" in caplog.text
    same_where_scored(actual, expected, token_mask)


@torch.no_grad()
def greedy(model, ids, mask, token_mask):
    """``ids`` with each response token replaced by the model's most likely one (top-k keeps it)."""
    ids = ids.clone()
    for j in range(1, ids.shape[1]):
        if token_mask[:, j].any():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask)).logits
            ids[:, j] = torch.where(token_mask[:, j] > 0, logits[:, j - 1].argmax(-1), ids[:, j])
    return ids, mask, token_mask


def test_policy_training_is_the_same_with_any_chunk_size(tiny_model_dir, registry):
    """Two optimizer steps with a KL term under top-k: the weights after them do not depend on the chunking."""
    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.records import TrainBatch

    results = []
    for chunk in ("null", "1"):
        cfg = load_config(None, [f"policy.model_name={tiny_model_dir}", f"policy.logprob_chunk_size={chunk}",
                                 "policy.train_global_batch_size=2", "policy.train_micro_batch_size=1",
                                 "policy.optimizer.lr=0.01", "grpo.num_prompts_per_step=1",
                                 "grpo.num_generations_per_prompt=4", "loss_fn.reference_policy_kl_penalty=0.1",
                                 "policy.generation.top_k=5"], registry)
        context = RunContext(config=cfg, run_dir=tiny_model_dir, model_path=str(tiny_model_dir),
                             tokenizer_path=str(tiny_model_dir), device="cpu", seed=0, needs_reference=True)
        policy = HFPolicy(None, context)
        ids, mask, token_mask = greedy(policy.model, *rows())  # sampled tokens are never filtered out
        batch = TrainBatch(input_ids=ids, attention_mask=mask, token_mask=token_mask, sample_mask=torch.ones(4),
                           generation_logprobs=torch.zeros(ids.shape), group_ids=torch.zeros(4, dtype=torch.long),
                           rewards=torch.zeros(4),
                           advantages=torch.randn(4, 14, generator=torch.Generator().manual_seed(2)))
        batch.prev_logprobs = policy.logprobs(batch)
        batch.reference_logprobs = policy.reference_logprobs(batch) - 0.1
        metrics = policy.train(batch, ClippedPGLoss(cfg.loss_fn))
        assert metrics["grad_norm"] > 0 and metrics["kl_penalty"] > 0
        results.append((metrics, policy.logprobs(batch), batch.prev_logprobs))
    (metrics, trained, before), (chunked_metrics, chunked_trained, _) = results
    assert chunked_metrics == pytest.approx(metrics, rel=1e-5, abs=1e-7)
    # Weights are compared through the logprobs they give: Adam turns the rounding noise of a gradient
    # that is exactly 0 in theory (GPT-2's key biases) into steps of ~lr, which change no output.
    torch.testing.assert_close(chunked_trained, trained, rtol=0, atol=1e-5)
    assert (trained - before).abs().max() > 1e-2  # the two optimizer steps moved the policy


def test_logprob_chunk_size_is_checked_and_refused_by_a_backend_without_it(registry, cli):
    import attrs

    from grpo_sdk.config.checks.policy import check_policy_batching
    from grpo_sdk.config.loading import load_config

    assert "policy.logprob_chunk_size" in config_problems(registry, "policy.logprob_chunk_size=0")
    cfg = load_config(None, ["policy.logprob_chunk_size=64"], registry)
    assert check_policy_batching(cfg, registry) == []  # hf declares logprob_chunks
    # megatron (not installed here, so its own load would stop earlier) does not declare it
    megatron = attrs.evolve(cfg, policy=attrs.evolve(cfg.policy, backend="megatron"))
    (key, message), = check_policy_batching(megatron, registry)
    assert key == "policy.logprob_chunk_size" and "does not declare the logprob_chunks capability" in message
    code, out, err = cli("config", "validate", "policy.logprob_chunk_size=-3")
    assert code == 2 and "policy.logprob_chunk_size" in err
