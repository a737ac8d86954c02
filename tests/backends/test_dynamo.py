"""The dynamo backend against stand-in Dynamo deployments over real HTTP (tests/engine_servers/dynamo_server.py).

What these tests prove: the adapter speaks the wire protocol of Dynamo's OpenAI frontend (as NeMo-RL
uses it) and of the vLLM worker's RL routes (as ai-dynamo 1.3.0.post1's handler checks them),
in the order those routes require; the token ids and processed logprobs it returns are the model's
(compared with an independent forward pass, and with the hf sampler under the same seed); a
collective sync through grpo-sdk's transport really changes every worker's weights; failures are
clear errors within a deadline. What they do not prove: that a real Dynamo deployment behaves so.
No Dynamo, vLLM or GPU runs here; the stand-in's group is grpo-sdk's gloo construction, not vLLM's
StatelessProcessGroup + PyNccl (docs/dynamo.md, "What has run").
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_servers.base import EngineModel, start_server

from grpo_sdk.backends.dynamo.config import DynamoConfig
from grpo_sdk.backends.dynamo.generation import DynamoGeneration, parse_completion
from grpo_sdk.plugins import GrpoSdkError, PausesForRefit, PluginError, ReceivesBroadcast, SamplingParams
from grpo_sdk.plugins.toolkit import HTTPClient, free_port
from grpo_sdk.weight_sync.collective import CollectiveWeightSync
from grpo_sdk.weight_sync.specs import CollectiveWeightSyncConfig

from helpers import config_problems, perturbed_policy, response_rows, run_grpoctl, tiny_run_context, token_rows

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    servers = [start_server("dynamo_server", tiny_model_dir, "--model-name", "tiny") for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def context_with_token_ids(tiny_model_dir, registry, reference):
    return tiny_run_context(tiny_model_dir, registry, pad_token_id=reference.pad_token_id,
                            eos_token_id=reference.eos_token_id)


def client(context_with_token_ids, frontend, worker_urls, **options):
    options = {"model_name": "tiny", "weight_transfer_backend": "gloo", "request_timeout_s": 60,
               "control_timeout_s": 60, **options}
    return DynamoGeneration(DynamoConfig(frontend_url=frontend, worker_urls=list(worker_urls), **options), context_with_token_ids)




def test_logprobs_are_the_models_processed_logprobs(workers, context_with_token_ids, tiny_model_dir, reference):
    """Temperature 0.7, no filter: each returned logprob equals log_softmax(logits / 0.7) of the sampled
    token in an independent transformers forward pass over prompt + response."""
    from transformers import AutoModelForCausalLM

    gen = client(context_with_token_ids, workers[0].url, [workers[0].url])
    assert isinstance(gen, ReceivesBroadcast) and isinstance(gen, PausesForRefit)
    out = gen.generate(token_rows(PROMPTS), SamplingParams(max_new_tokens=8, temperature=0.7))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    for prompt, (tokens, logprobs, truncated) in zip(PROMPTS, response_rows(out)):
        assert tokens and truncated == (len(tokens) == 8 and tokens[-1] != reference.eos_token_id)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
        expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs, dtype=torch.double), expected, atol=1e-5)
    assert out.weight_version == 0 and out.response_ids.shape[0] == len(PROMPTS)


def test_seeded_top_k_top_p_equal_the_hf_sampler_and_repeat(workers, context_with_token_ids, reference):
    gen = client(context_with_token_ids, workers[0].url, [workers[0].url])
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=5, top_p=0.9, seed=11)
    first, again = response_rows(gen.generate(token_rows(PROMPTS), sampling)), response_rows(gen.generate(token_rows(PROMPTS), sampling))
    assert [r[0] for r in first] == [r[0] for r in again]
    for i, (prompt, (tokens, logprobs, truncated)) in enumerate(zip(PROMPTS, first)):
        expected = reference.generate([prompt], max_new_tokens=6, top_k=5, top_p=0.9, seed=11 + i)[0]
        assert tokens == expected.tokens and truncated == (expected.finish_reason == "length")
        assert logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    other = response_rows(gen.generate(token_rows(PROMPTS), SamplingParams(max_new_tokens=6, top_k=5, top_p=0.9, seed=12)))
    assert [r[0] for r in other] != [r[0] for r in first]


def test_stop_tokens_end_the_response_and_are_included_and_length_truncates(workers, context_with_token_ids, reference):
    gen = client(context_with_token_ids, workers[0].url, [workers[0].url])
    long = response_rows(gen.generate(token_rows(PROMPTS[:1]), SamplingParams(max_new_tokens=8, seed=3)))[0][0]
    stop = long[2]
    tokens, _, truncated = response_rows(gen.generate(token_rows(PROMPTS[:1]), SamplingParams(max_new_tokens=8, seed=3,
                                                                                   stop_token_ids=(stop,))))[0]
    assert tokens == long[:long.index(stop) + 1] and tokens[-1] == stop and not truncated
    short = response_rows(gen.generate(token_rows(PROMPTS), SamplingParams(max_new_tokens=2, seed=3)))
    assert all(len(t) <= 2 for t, _, _ in short)
    assert all(tr == (len(t) == 2 and t[-1] != reference.eos_token_id) for t, _, tr in short)


def test_collective_sync_updates_both_workers_at_their_ranks_and_versions(workers, context_with_token_ids, tiny_model_dir):
    """grpo-sdk's collective transport as rank 0 (world size 3): worker 0 joins at rank 1, worker 1 at
    rank 2; after each sync both frontends sample what the hf sampler samples under the new weights,
    and both workers report the version."""
    gen = client(context_with_token_ids, workers[0].url, [w.url for w in workers])
    assert gen.broadcast_ranks() == 2
    on_second = client(context_with_token_ids, workers[1].url, [workers[1].url])
    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(bucket_mb=0.05, timeout_s=60, backend="gloo"), context_with_token_ids)
    new = EngineModel(str(tiny_model_dir))
    sampling = SamplingParams(max_new_tokens=6, seed=4)
    before = response_rows(gen.generate(token_rows(PROMPTS), sampling))
    try:
        for version in (1, 2):
            policy = perturbed_policy(context_with_token_ids, version, 0.05)
            stats = sync.sync_weights(policy, gen, version=version)
            assert stats.version == version
            new.load_tensors(list(policy.named_weights()))
            for frontend in (gen, on_second):
                out = frontend.generate(token_rows(PROMPTS), sampling)
                for i, (tokens, logprobs, _) in enumerate(response_rows(out)):
                    expected = new.generate([PROMPTS[i]], max_new_tokens=6, seed=4 + i)[0]
                    assert tokens == expected.tokens and logprobs == pytest.approx(expected.logprobs, abs=1e-5)
            assert gen.weight_version == version and out.weight_version in (0, version)
            for w in workers:
                assert HTTPClient(w.url, timeout_s=10, what="x").post("/engine/get_weight_version")["version"] == str(version)
        assert response_rows(gen.generate(token_rows(PROMPTS), sampling)) != before
    finally:
        sync.shutdown()


def test_a_worker_that_does_not_take_the_update_fails_the_sync(tiny_model_dir, context_with_token_ids):
    stale = start_server("dynamo_server", tiny_model_dir, "--model-name", "tiny", "--ignore-weight-version")
    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(timeout_s=60, backend="gloo"), context_with_token_ids)
    try:
        gen = client(context_with_token_ids, stale.url, [stale.url])
        with pytest.raises(GrpoSdkError, match=r"report another weight version than '1'.*did not take it"):
            sync.sync_weights(perturbed_policy(context_with_token_ids, 7, 0.05), gen, version=1)
        assert gen.weight_version == 0
    finally:
        sync.shutdown()
        stale.stop()


def test_pause_drains_then_holds_new_requests_until_resume_and_refuses_in_flight(workers, context_with_token_ids):
    gen = client(context_with_token_ids, workers[0].url, [workers[0].url])
    with pytest.raises(PluginError, match="in_flight_weight_updates=false"):
        gen.pause_generation(keep_in_flight=True)
    results = {}
    running = threading.Thread(target=lambda: results.update(first=gen.generate(token_rows(PROMPTS), SamplingParams(
        max_new_tokens=24, seed=1))))
    running.start()
    deadline = time.monotonic() + 30
    while not gen._running and time.monotonic() < deadline:  # the generate is in flight (a busy machine is slow)
        time.sleep(0.01)
    gen.pause_generation(keep_in_flight=False)
    assert "first" in results  # drained: the running generate had finished
    held = threading.Thread(target=lambda: results.update(second=gen.generate(token_rows(PROMPTS[:1]), SamplingParams(
        max_new_tokens=2))))
    held.start()
    time.sleep(0.5)
    assert "second" not in results and held.is_alive()
    gen.resume_generation(recompute_kv_cache=False)
    held.join(timeout=30)
    running.join(timeout=30)
    assert "second" in results


def test_errors_name_the_route_and_come_within_the_deadline(workers, context_with_token_ids, tiny_model_dir):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(GrpoSdkError, match=r"no answer from GET .*/v1/models.*policy.generation.dynamo.frontend_url"):
        client(context_with_token_ids, dead, [workers[0].url])
    with pytest.raises(GrpoSdkError, match=r"no answer from GET .*/health.*worker_urls\[1\]"):
        client(context_with_token_ids, workers[0].url, [workers[0].url, dead])
    with pytest.raises(GrpoSdkError, match=r"does not serve 'other'.*model_name"):
        client(context_with_token_ids, workers[0].url, [workers[0].url], model_name="other")
    flaky = start_server("dynamo_server", tiny_model_dir, "--model-name", "tiny")
    try:
        gen = client(context_with_token_ids, flaky.url, [flaky.url], request_timeout_s=2, control_timeout_s=2)
        # An engine error ({"status": "error"}, HTTP 200): receiving before the worker joined a group.
        with pytest.raises(GrpoSdkError, match=r"route /engine/update_weights_from_distributed failed: .*weight-update "
                                               r"group"):
            gen.receive_broadcast([("w", (2,), "float32")], group_name="g", version=1, last=True)
        gen.resume_generation(recompute_kv_cache=False)  # the failed sync left the worker paused, as it should
        # HTTP errors from a worker and from the frontend, then a deployment that stops answering.
        HTTPClient(flaky.url, timeout_s=10, what="x").post("/standin/fail", {"path": "/engine/pause_generation",
                                                                            "status": 500, "message": "boom"})
        with pytest.raises(GrpoSdkError, match=r"POST .*/engine/pause_generation failed: HTTP 500: .*boom"):
            gen.pause_generation(keep_in_flight=False)
        HTTPClient(flaky.url, timeout_s=10, what="x").post("/standin/fail", {"path": "/v1/completions",
                                                                            "status": 500, "message": "engine died"})
        gen.resume_generation(recompute_kv_cache=False)
        with pytest.raises(GrpoSdkError, match=r"POST .*/v1/completions failed: HTTP 500: .*engine died"):
            gen.generate(token_rows(PROMPTS), SamplingParams(max_new_tokens=2))
        flaky.process.send_signal(19)  # SIGSTOP: the socket accepts, nothing answers
        start = time.monotonic()
        with pytest.raises(GrpoSdkError, match=r"no answer from POST .*/engine/resume_generation within 2 s"):
            gen.resume_generation(recompute_kv_cache=False)
        assert time.monotonic() - start < 10
    finally:
        flaky.process.kill()
        flaky.process.wait(timeout=10)


def test_config_checks(registry, tmp_path):
    found = config_problems(registry, "policy.generation.backend=dynamo", "grpo.async_grpo.enabled=true",
                            "grpo.async_grpo.in_flight_weight_updates=true")
    assert "is required" in found["policy.generation.dynamo.frontend_url"]
    assert "is required" in found["policy.generation.dynamo.worker_urls"]
    assert "must be false" in found["policy.generation.colocated.enabled"]
    assert "must be collective" in found["weight_sync.backend"]
    assert "layerwise weight reload" in found["grpo.async_grpo.in_flight_weight_updates"]
    found = config_problems(registry, "policy.generation.backend=dynamo", "policy.generation.colocated.enabled=false",
                            "weight_sync.backend=collective", "policy.generation.dynamo.frontend_url=frontend:8000",
                            "policy.generation.dynamo.worker_urls=[http://a:1,http://a:1]")
    assert "not an http(s) URL" in found["policy.generation.dynamo.frontend_url"]
    assert "twice" in found["policy.generation.dynamo.worker_urls"]
    found = config_problems(registry, "policy.generation.backend=dynamo", "cluster.runtime=ray",
                            "cluster.generation_workers=2")
    assert "one client drives the whole deployment" in found["cluster.generation_workers"]
    result = run_grpoctl("config", "validate", "policy.generation.backend=dynamo", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "policy.generation.dynamo.frontend_url" in result.stderr + result.stdout


def test_contract_kit_trains_through_the_stand_in_with_the_collective_transport(workers, tiny_model_dir):
    """Two GRPO steps of the built-in recipe (grpo_sdk.testing.run_training): generation through the
    stand-in's frontend, weights through the collective transport into both workers, the kit's
    checks that generation sampled with the last synced weights (version, token_mult_prob_error)."""
    from grpo_sdk.testing import run_training

    metrics = run_training("generation", "dynamo", [
        f"policy.generation.dynamo.frontend_url={workers[0].url}/v1",
        f"policy.generation.dynamo.worker_urls=[{workers[0].url},{workers[1].url}]",
        "policy.generation.dynamo.model_name=tiny", "policy.generation.dynamo.weight_transfer_backend=gloo",
        "policy.generation.colocated.enabled=false", "weight_sync.backend=collective",
        "weight_sync.collective.backend=gloo"], steps=2, model_dir=tiny_model_dir)
    assert len(metrics) == 2


@pytest.mark.parametrize(("reply", "error"), [
    ({"choices": []}, "has no choices"),
    ({"choices": [{"finish_reason": "stop", "logprobs": {"token_logprobs": [-1.0]}}]}, "no nvext.completion_token_ids"),
    ({"choices": [{"finish_reason": "abort"}], "nvext": {"completion_token_ids": [4]}}, "finish_reason='abort'"),
    ({"choices": [{"finish_reason": "stop", "logprobs": None}], "nvext": {"completion_token_ids": [4, 5]}},
     "0 token logprobs for 2 tokens; the workers must run with --enable-rl"),
])
def test_a_malformed_completion_reply_is_a_clear_error(reply, error):
    with pytest.raises(GrpoSdkError, match=error.replace("(", r"\(").replace(")", r"\)")):
        parse_completion(reply, "http://frontend/v1/completions")
    ok = {"choices": [{"finish_reason": "length", "logprobs": {"token_logprobs": [-0.5, -1]}}],
          "nvext": {"completion_token_ids": [4, 5]}}
    assert parse_completion(ok, "u") == ([4, 5], [-0.5, -1.0], True)


def test_tensor_uploads_are_refused(workers, context_with_token_ids):
    gen = client(context_with_token_ids, workers[0].url, [workers[0].url])
    with pytest.raises(PluginError, match="weight_sync.backend=collective"):
        gen.update_weights([("w", torch.zeros(1))], version=1)


def test_the_stand_in_enforces_the_handlers_rules(workers):
    """The stand-in refuses what ai-dynamo 1.3.0.post1's BaseWorkerHandler refuses, so an adapter that
    skipped the pause or sent a bad combination would fail the tests above."""
    worker = HTTPClient(workers[1].url, timeout_s=10, what="stand-in")
    unpaused = worker.post("/engine/update_weights_from_distributed", {"engine_rpc": "start_weight_update"})
    assert unpaused["status"] == "error" and "must be paused" in unpaused["message"]
    both = worker.post("/engine/update_weights_from_distributed", {"engine_rpc": "start_weight_update",
                                                                    "allow_unpaused": True, "reset_prefix_cache": True})
    assert both["status"] == "error" and "cannot reset the prefix cache" in both["message"]
    assert worker.post("/engine/pause_generation", {"mode": "later"})["status"] == "error"
    assert "not implemented" in worker.post("/engine/update_weights_from_tensor", {})["message"]
