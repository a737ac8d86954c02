"""The hf backend's continuous-batching sampler (issue 35): finished rows leave the batch, waiting rows
are admitted, one prefill per prompt, a row's tokens are its own whatever the batch, per-row budgets,
and AsyncGeneration's submit / poll / cancel, on a tiny local GPT-2."""

from __future__ import annotations

import attrs
import pytest
import torch

from grpo_sdk.backends.hf.config import HFGenerationConfig
from grpo_sdk.backends.hf.generation import HFGeneration
from grpo_sdk.config.context import RunContext
from grpo_sdk.config.loading import load_config
from grpo_sdk.core.records import GenerationInput, SamplingParams
from helpers import prompt_batch

PROMPTS = ["1>", "12345>", "987>", "55555555>"]
SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0)


def make_generation(model_dir, registry, **options) -> HFGeneration:
    cfg = load_config(None, [f"policy.model_name={model_dir}"], registry)
    context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                         device="cpu", seed=0, needs_reference=False)
    return HFGeneration(HFGenerationConfig(**options), context)


def with_seeds(inputs: GenerationInput, seeds) -> GenerationInput:
    return attrs.evolve(inputs, seeds=torch.tensor(seeds))


def rows_of(out, i):
    n = int(out.response_lengths[i])
    return out.response_ids[i, :n].tolist(), out.logprobs[i, :n]


def record_forwards(gen):
    """Every forward pass of ``gen``: (rows, columns of input ids)."""
    calls, forward = [], gen._forward

    def recorded(**kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))
        return forward(**kwargs)

    gen._forward = recorded
    return calls


@pytest.fixture
def gen(tiny_model_dir, registry):
    return make_generation(tiny_model_dir, registry)


def test_a_rows_tokens_are_its_own_alone_in_a_batch_and_admitted_late(tiny_model_dir, registry, tokenizer):
    """Row "987>" with seed 5: the same tokens (and logprobs to float tolerance) sampled alone, in the
    middle of a batch of other prompts and seeds, and admitted late behind a full batch."""
    alone = make_generation(tiny_model_dir, registry).generate(
        with_seeds(prompt_batch(tokenizer, ["987>"]), [5]), SAMPLING)
    batch = prompt_batch(tokenizer, PROMPTS * 2)
    seeds = [11, 12, 5, 13, 14, 15, 16, 17]  # row 2 is "987>"
    together = make_generation(tiny_model_dir, registry).generate(with_seeds(batch, seeds), SAMPLING)
    late_gen = make_generation(tiny_model_dir, registry, max_num_seqs=2)
    late_batch = prompt_batch(tokenizer, PROMPTS * 2 + ["987>"])
    late = late_gen.generate(with_seeds(late_batch, seeds + [5]), SAMPLING)
    tokens, logprobs = rows_of(alone, 0)
    assert len(tokens) > 1
    for out, i in ((together, 2), (late, 8)):
        other_tokens, other_logprobs = rows_of(out, i)
        assert other_tokens == tokens
        torch.testing.assert_close(other_logprobs, logprobs, atol=1e-5, rtol=0)
    assert rows_of(together, 6)[0] != tokens  # the same prompt with another seed samples otherwise


def test_greedy_equals_the_whole_batch_loop(tiny_model_dir, registry, tokenizer):
    inputs = prompt_batch(tokenizer, PROMPTS * 3)
    greedy = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1)
    new = make_generation(tiny_model_dir, registry).generate(inputs, greedy)
    old = make_generation(tiny_model_dir, registry, continuous_batching=False).generate(inputs, greedy)
    assert torch.equal(new.response_lengths, old.response_lengths)
    assert torch.equal(new.response_ids, old.response_ids) and torch.equal(new.truncated, old.truncated)
    torch.testing.assert_close(new.logprobs, old.logprobs, atol=1e-5, rtol=0)


def test_finished_rows_stop_costing_decode_steps(gen, tokenizer):
    """Each row runs one decode forward per token after its first (the first comes from the prefill):
    the batch costs the sum of its rows' lengths, not rows x longest."""
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123456789")))
    inputs = prompt_batch(tokenizer, PROMPTS * 8)
    out = gen.generate(inputs, SamplingParams(max_new_tokens=12, stop_token_ids=digits))
    lengths = out.response_lengths
    assert lengths.min() < lengths.max(), "the seed gives rows of several lengths"
    assert gen.sampler.decode_rows == int((lengths - 1).clamp(min=0).sum())
    assert gen.sampler.decode_rows < len(lengths) * (int(lengths.max()) - 1)
    assert gen.sampler.idle and gen.sampler.cache is None  # nothing held after the call


def test_the_samples_of_a_prompt_share_one_prefill(gen, tokenizer):
    calls = record_forwards(gen)
    gen.generate(prompt_batch(tokenizer, [p for p in PROMPTS for _ in range(4)]), SAMPLING)
    prefills = [shape for shape in calls if shape[1] > 1]
    assert prefills == [(4, prefills[0][1])]  # one forward pass over the 4 distinct prompts, for 16 rows


def test_waiting_rows_are_admitted_as_rows_finish(tiny_model_dir, registry, tokenizer):
    inputs = with_seeds(prompt_batch(tokenizer, PROMPTS * 2), list(range(8)))
    wide = make_generation(tiny_model_dir, registry).generate(inputs, SAMPLING)
    narrow_gen = make_generation(tiny_model_dir, registry, max_num_seqs=3)
    running, step = [], narrow_gen.sampler.step

    def counted(between):
        out = step(between)
        running.append(len(narrow_gen.sampler.rows))
        return out

    narrow_gen.sampler.step = counted
    narrow = narrow_gen.generate(inputs, SAMPLING)
    assert max(running) == 3
    assert torch.equal(narrow.response_ids, wide.response_ids)
    torch.testing.assert_close(narrow.logprobs, wide.logprobs, atol=1e-5, rtol=0)


def test_per_row_budgets_and_ignore_eos_decode_exact_lengths(tiny_model_dir, registry, tokenizer):
    budgets = torch.tensor([0, 1, 7, 12, 3, 12, 5, 2])
    inputs = attrs.evolve(prompt_batch(tokenizer, PROMPTS * 2), max_new_tokens=budgets)
    for continuous in (True, False):
        gen = make_generation(tiny_model_dir, registry, continuous_batching=continuous)
        out = gen.generate(inputs, attrs.evolve(SAMPLING, ignore_eos=True))
        assert out.response_lengths.tolist() == budgets.tolist(), continuous
        assert out.truncated.all()  # no stop token: every row ran to its budget


def test_submitted_requests_come_back_from_poll_and_cancelled_ones_never(gen, tokenizer):
    gen.submit("a", prompt_batch(tokenizer, PROMPTS), SAMPLING)
    gen.submit("b", prompt_batch(tokenizer, ["1>"]), attrs.evolve(SAMPLING, max_new_tokens=40))
    gen.submit("c", prompt_batch(tokenizer, ["12>"] * 3), SAMPLING)
    gen.cancel(["c"])
    results = {}
    for _ in range(200):
        results.update(gen.poll(0.05))
        if len(results) == 2:
            break
    assert sorted(results) == ["a", "b"]
    assert results["a"].response_ids.shape[0] == 4 and results["b"].response_ids.shape[0] == 1
    assert gen.poll(0.01) == [] and gen.sampler.idle
    with pytest.raises(ValueError, match="not yet polled"):
        gen.submit("d", prompt_batch(tokenizer, ["1>"]), SAMPLING)
        gen.submit("d", prompt_batch(tokenizer, ["1>"]), SAMPLING)


def test_a_failed_step_fails_the_requests_in_flight_and_the_sampler_goes_on(gen, tokenizer):
    forward = gen._forward

    def broken(**kwargs):
        raise RuntimeError("forward failed")

    gen.submit("x", prompt_batch(tokenizer, PROMPTS), SAMPLING)
    gen._forward = broken
    [(request_id, error)] = gen.poll(1.0)
    assert request_id == "x" and isinstance(error, RuntimeError) and gen.sampler.idle
    with pytest.raises(RuntimeError, match="forward failed"):
        gen.generate(prompt_batch(tokenizer, PROMPTS), SAMPLING)
    gen._forward = forward
    assert gen.generate(prompt_batch(tokenizer, PROMPTS), SAMPLING).response_ids.shape[0] == 4


def test_a_continuation_prefills_only_what_the_kept_prefix_lacks(tiny_model_dir, registry, tokenizer):
    """A multi-turn episode's next prompt (its context + the environment's turn) reuses the KV its
    first turn left: only the new tokens are prefilled, and the tokens and logprobs are those of a
    full prefill. finish_generation drops what was kept."""
    first = with_seeds(prompt_batch(tokenizer, PROMPTS * 2), list(range(8)))
    turn = tokenizer("=>")["input_ids"]

    def two_turns(gen):
        out = gen.generate(first, SAMPLING)
        contexts = [first.input_ids[i][first.attention_mask[i].bool()].tolist() + rows_of(out, i)[0] + turn
                    for i in range(8)]
        from grpo_sdk.plugins.tensors import left_pad
        ids, mask = left_pad(contexts, tokenizer.pad_token_id)
        calls = record_forwards(gen)
        second = gen.generate(GenerationInput(input_ids=ids, attention_mask=mask, seeds=torch.arange(8) + 100),
                              SAMPLING)
        return second, [shape for shape in calls if shape[1] > 1], ids.shape[1]

    kept_gen = make_generation(tiny_model_dir, registry)
    kept, kept_prefills, width = two_turns(kept_gen)
    full, full_prefills, _ = two_turns(make_generation(tiny_model_dir, registry, prefix_cache_tokens=0))
    assert full_prefills == [(8, width)]
    assert kept_prefills == [(8, 1 + len(turn))]  # each row's last sampled token and the turn
    assert kept_gen.sampler.prefixes.hits == 8
    assert torch.equal(kept.response_ids, full.response_ids)
    torch.testing.assert_close(kept.logprobs, full.logprobs, atol=1e-5, rtol=0)
    assert kept_gen.sampler.prefixes.tokens > 0
    kept_gen.finish_generation()
    assert kept_gen.sampler.prefixes.tokens == 0 and not kept_gen.sampler.prefixes.entries


def test_a_weight_update_makes_kept_prefixes_stale(gen, tokenizer):
    first = prompt_batch(tokenizer, PROMPTS)
    out = gen.generate(first, SAMPLING)
    assert gen.sampler.prefixes.entries
    gen.update_weights(list(gen.model.state_dict().items()), version=1)
    context = [first.input_ids[0][first.attention_mask[0].bool()].tolist() + rows_of(out, 0)[0] + [5]]
    gen.generate(GenerationInput(input_ids=torch.tensor(context), attention_mask=torch.ones(1, len(context[0]),
                                                                                             dtype=torch.long)),
                 SAMPLING)
    assert gen.sampler.prefixes.hits == 0  # the old weights' KV is never read by the new ones


def test_row_uniforms_are_a_function_of_seed_and_index_alone():
    from grpo_sdk.plugins.tensors import row_uniforms

    seeds = torch.tensor([0, 1, -5, 2**62, -(2**63)])
    u = row_uniforms(seeds, torch.tensor([0, 0, 3, 7, 9]))
    assert torch.equal(u, row_uniforms(seeds, torch.tensor([0, 0, 3, 7, 9])))
    assert torch.equal(u[2:3], row_uniforms(seeds[2:3], torch.tensor([3])))  # alone: the same draw
    many = row_uniforms(torch.full((20000,), 12345), torch.arange(20000))
    assert 0 <= float(many.min()) and float(many.max()) < 1 and len(set(many.tolist())) == 20000
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float((many < 0.1).float().mean()) - 0.1) < 0.01


@pytest.mark.parametrize("options", [{"continuous_batching": False}, {"continuous_batching": True}])
def test_only_the_sampler_takes_requests_one_at_a_time_and_the_serving_engine_uses_what_there_is(
        tiny_model_dir, registry, tokenizer, options):
    """The whole-batch loop (continuous_batching=false, or compile) is no AsyncGeneration: the serving
    engine and the rollouts then batch requests into ``generate`` (they once called a submit that refused)."""
    from grpo_sdk.core.optional_protocols import AsyncGeneration
    from grpo_sdk.serving.engine import GenerationEngine

    generation = make_generation(tiny_model_dir, registry, **options)
    assert isinstance(generation, AsyncGeneration) == options["continuous_batching"]
    engine = GenerationEngine(generation, pad_token_id=tokenizer.pad_token_id)
    assert engine.streaming == options["continuous_batching"]
    engine.start()
    try:
        sampled = engine.generate(tokenizer("123>")["input_ids"], SamplingParams(max_new_tokens=6, seed=3),
                                  timeout_s=60)
    finally:
        engine.stop()
    assert 1 <= len(sampled.ids) <= 6 and len(sampled.logprobs) == len(sampled.ids)
