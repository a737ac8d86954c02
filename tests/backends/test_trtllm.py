"""The trtllm backend in server mode against a stand-in trtllm-serve over real HTTP
(tests/engine_servers/trtllm_server.py: trtllm-serve's routes and shapes, as read in TensorRT-LLM's
``serve/openai_server.py`` / ``openai_protocol.py``, on a real tiny transformers model).

What these tests prove: the adapter speaks trtllm-serve's wire protocol as its source defines it
(/v1/completions with token ids, detokenize=false, logprobs=1, include_stop_str_in_output; the RL
routes /update_weights, /release_memory, /resume_memory), the token ids and logprobs it returns are
the model's (compared with the same sampler in this process, seed for seed), each of the weight
paths it declares really changes the served weights (the commands reach grpo-sdk's real
``GrpoWorkerExtension`` in the stand-in's process, on FAKE upstream base classes, which joins a real
gloo group and loads into the real model), and failures are clear errors within a deadline.
What they do not prove: that a real trtllm-serve (or TensorRT-LLM worker) behaves so. No TensorRT-LLM
and no GPU run here; the CUDA IPC path is not exercised (the stand-in refuses handles, having no GPU).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from engine_servers.base import start_server

from grpo_sdk.backends.trtllm.config import TrtllmConfig
from grpo_sdk.backends.trtllm.generation import TrtllmGeneration
from grpo_sdk.backends.trtllm.refit import command
from grpo_sdk.backends.trtllm.server import TrtllmServerGeneration
from grpo_sdk.config.loading import load_config
from grpo_sdk.plugins import GrpoSdkError, PluginError, SamplingParams
from grpo_sdk.plugins.tensors import write_weights
from grpo_sdk.plugins.toolkit import HTTPClient
from grpo_sdk.weight_sync.collective import CollectiveWeightSync
from grpo_sdk.weight_sync.specs import CollectiveWeightSyncConfig

from helpers import config_problems, perturbed_policy, response_rows, run_grpoctl, token_rows

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = start_server("trtllm_server", tiny_model_dir)
    yield server
    server.stop()


def client(context, url, **options) -> TrtllmServerGeneration:
    generation = TrtllmGeneration(TrtllmConfig(mode="server", url=url, request_timeout_s=60, **options), context)
    assert isinstance(generation, TrtllmServerGeneration)
    return generation




def seeds(seed, rows):
    return [(seed * 1_000_003 + row) % 2**31 for row in range(rows)]


def expected(reference, rows, sampling):
    """What the sampler gives each row under the seed the adapter sends it (row_seeds' formula)."""
    out = []
    for row, seed in zip(rows, seeds(sampling.seed, len(rows))):
        done = reference.generate([row], max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                  stop_token_ids=sampling.stop_token_ids, seed=seed)[0]
        out.append((done.tokens, done.logprobs, done.finish_reason == "length"))
    return out


def test_tokens_logprobs_and_stop_tokens_are_the_models(server, context, reference):
    """Seeded rows: the adapter's token ids, logprobs and truncation flags equal the sampler's under
    the per-row seeds it sends; a stop token ends a row and stays in it (include_stop_str_in_output)."""
    generation = client(context, server.url)
    free = SamplingParams(max_new_tokens=6, seed=11)
    got = response_rows(generation.generate(token_rows(PROMPTS), free))
    want = expected(reference, PROMPTS, free)
    for (tokens, logprobs, truncated), (w_tokens, w_logprobs, w_truncated) in zip(got, want):
        assert tokens == w_tokens and truncated == w_truncated
        assert logprobs == pytest.approx(w_logprobs, abs=1e-5)
    stop = got[0][0][1]  # a token row 0 samples: with it as a stop token, row 0 ends at its first occurrence
    stop_sampling = SamplingParams(max_new_tokens=6, seed=11, stop_token_ids=(stop,))
    stopped = response_rows(generation.generate(token_rows(PROMPTS), stop_sampling))
    assert stopped[0][0] == got[0][0][:got[0][0].index(stop) + 1] and stopped[0][2] is False
    for (tokens, logprobs, truncated), (w_tokens, w_logprobs, w_truncated) in zip(
            stopped, expected(reference, PROMPTS, stop_sampling)):
        assert tokens == w_tokens and truncated == w_truncated
        assert logprobs == pytest.approx(w_logprobs, abs=1e-5)


def test_identical_prompts_get_their_own_samples(server, context):
    """trtllm-serve treats a missing seed as seed 0 (the stand-in too): only per-row seeds make the G
    samples of one prompt differ. Unseeded calls also differ from call to call."""
    generation = client(context, server.url)
    sampling = SamplingParams(max_new_tokens=8)
    first = response_rows(generation.generate(token_rows([[5, 6, 7]] * 4), sampling))
    second = response_rows(generation.generate(token_rows([[5, 6, 7]] * 4), sampling))
    assert len({tuple(t) for t, _, _ in first}) > 1
    assert [t for t, _, _ in first] != [t for t, _, _ in second]


def assert_serves(generation, reference, policy, version):
    """The server now samples with the policy's weights: same tokens and logprobs as the sampler
    loaded with them, and the adapter reports the version."""
    reference.load_tensors(list(policy.named_weights()), version=version)
    sampling = SamplingParams(max_new_tokens=5, seed=3)
    out = generation.generate(token_rows(PROMPTS), sampling)
    assert out.weight_version == version
    for (tokens, logprobs, _), (w_tokens, w_logprobs, _) in zip(response_rows(out), expected(reference, PROMPTS, sampling)):
        assert tokens == w_tokens
        assert logprobs == pytest.approx(w_logprobs, abs=1e-5)


def test_every_weight_path_changes_what_the_server_samples(server, context, reference, tmp_path):
    """update_weights with CPU tensors (a file through the load_file command), load_weights (the disk
    transport's file) and the collective transport (the engine joins grpo-sdk's group and receives
    each tensor): after each, the server samples exactly as the sampler loaded with those weights."""
    generation = client(context, server.url)
    before = response_rows(generation.generate(token_rows(PROMPTS), SamplingParams(max_new_tokens=5, seed=3)))

    policy = perturbed_policy(context, 1, 0.05)
    generation.update_weights(policy.named_weights(), version=1)
    assert_serves(generation, reference, policy, 1)
    assert response_rows(generation.generate(token_rows(PROMPTS), SamplingParams(max_new_tokens=5, seed=3))) != before

    policy = perturbed_policy(context, 2, 0.05)
    path = tmp_path / "weights_v2.safetensors"
    write_weights(policy.named_weights(), path)
    generation.load_weights(str(path), version=2)
    assert_serves(generation, reference, policy, 2)

    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(bucket_mb=0.05, timeout_s=60), context)
    try:
        for version, seed in ((3, 3), (4, 4)):  # the group is joined once, then reused
            policy = perturbed_policy(context, seed, 0.05)
            stats = sync.sync_weights(policy, generation, version=version)
            assert stats.num_tensors == len(list(policy.named_weights()))
            assert_serves(generation, reference, policy, version)
    finally:
        sync.shutdown()


def test_release_after_generation_and_resume_before_the_next(server, context, tiny_model_dir):
    """enable_sleep: finish_generation POSTs /release_memory (the engine then cannot serve: HTTP 500),
    prepare_for_generation /resume_memory, and generate resumes a released engine by itself."""
    generation = client(context, server.url, enable_sleep=True)
    http = HTTPClient(server.url, timeout_s=30, what="test")
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 2, "detokenize": False, "logprobs": 1}
    generation.finish_generation()
    with pytest.raises(GrpoSdkError, match=r"/v1/completions failed: HTTP 500: .*released"):
        http.post("/v1/completions", body)
    generation.prepare_for_generation()
    served = http.post("/v1/completions", body)["choices"][0]  # served again (its tokens may be just a stop)
    assert served["finish_reason"] in ("stop", "length") and served["logprobs"] is not None
    generation.finish_generation()
    assert generation.generate(token_rows(PROMPTS), SamplingParams(max_new_tokens=2)).response_ids.shape[0] == 3
    generation.prepare_for_generation()


def test_a_failed_update_names_the_route_and_the_servers_message(server, context):
    generation = client(context, server.url)
    with pytest.raises(GrpoSdkError, match=r"POST .*/update_weights failed: HTTP 500: .*No such file"):
        generation._update(command("load_file", path="/no/such/file.safetensors", version=9, last=True))
    with pytest.raises(GrpoSdkError, match=r"/update_weights failed: HTTP 500: .*CUDA IPC handles need a GPU"):
        generation._update({"GPU-0000": "aGFuZGxlcw=="})  # upstream's IPC payload: the stand-in has no GPU
    assert generation.weight_version == 0
    upstream_only = client(context, server.url, worker_extension=False)
    with pytest.raises(PluginError, match="takes CUDA IPC handles only"):
        upstream_only.update_weights([("w", torch.zeros(2))], version=1)


def test_no_server_and_a_server_that_dies_are_clear_errors_within_the_deadline(context, tiny_model_dir):
    start = time.monotonic()
    with pytest.raises(GrpoSdkError, match=r"no answer from GET http://127.0.0.1:9/health .*policy.generation.trtllm.url"):
        client(context, "http://127.0.0.1:9")
    dying = start_server("trtllm_server", tiny_model_dir, "--exit-in-generate")
    try:
        generation = client(context, dying.url)
        with pytest.raises(GrpoSdkError, match=r"no answer from POST .*/v1/completions"):
            generation.generate(token_rows(PROMPTS), SamplingParams(max_new_tokens=4))
    finally:
        dying.stop()
    assert time.monotonic() - start < 60


def test_config_checks(registry, tiny_model_dir):
    base = [f"policy.model_name={tiny_model_dir}", "policy.generation.backend=trtllm",
            "policy.generation.trtllm.mode=server"]
    assert "server mode needs the trtllm-serve URL" in config_problems(registry, *base)["policy.generation.trtllm.url"]
    url = "policy.generation.trtllm.url=http://127.0.0.1:1"
    raw = config_problems(registry, *base, url, "policy.generation.temperature=0.7")
    assert "RAW logprobs" in raw["policy.generation.trtllm.accept_raw_logprobs"]
    load_config(None, [*base, url, "policy.generation.temperature=0.7",
                       "policy.generation.trtllm.accept_raw_logprobs=true"], registry)  # told: accepted
    disk = config_problems(registry, *base, url, "policy.generation.trtllm.worker_extension=false",
                           "weight_sync.backend=disk")
    assert "worker extension" in disk["policy.generation.trtllm.worker_extension"]
    cpu = config_problems(registry, *base, url, "policy.generation.trtllm.worker_extension=false",
                          "weight_sync.backend=inprocess", "cluster.device=cpu")
    assert "send CUDA tensors" in cpu["policy.generation.trtllm.worker_extension"]
    inflight = config_problems(registry, *base, url, "grpo.async_grpo.enabled=true",
                               "grpo.async_grpo.in_flight_weight_updates=true")
    assert "which weights sampled" in inflight["grpo.async_grpo.in_flight_weight_updates"]


def test_a_bad_config_exits_2_naming_the_key(tmp_path):
    result = run_grpoctl("config", "validate", "policy.generation.backend=trtllm", "policy.generation.trtllm.mode=server",
                         cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "policy.generation.trtllm.url" in result.stderr and "server mode needs the trtllm-serve URL" in result.stderr


def test_engine_mode_without_tensorrt_llm_exits_3_with_the_install_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed here")
    result = run_grpoctl("run", "--run-dir", "run", "policy.model_name=builtin:tiny-gpt2",
                         "policy.generation.backend=trtllm", cwd=tmp_path, timeout=300)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "pip install 'grpo-sdk[trtllm]' --extra-index-url https://pypi.nvidia.com" in result.stderr


def test_the_contract_kit_protocols_hold():
    from grpo_sdk.testing import check_light, check_protocol, check_spec

    assert check_spec("generation", "trtllm").name == "trtllm"
    check_light("generation", "trtllm")  # raises when spec or config imports torch or an engine
    assert check_protocol("generation", "trtllm") is TrtllmGeneration


@pytest.mark.parametrize("transport", ["inprocess", "disk", "collective"])
def test_the_contract_kit_trains_through_the_server(tmp_path, tiny_model_dir, server, transport):
    """Two GRPO steps of the built-in recipe through the real trainer with the stand-in generating,
    the weights synced by ``transport``; the kit's probe then checks the server samples the synced
    weights (version and logprobs)."""
    from grpo_sdk.testing import run_training

    rows = run_training("generation", "trtllm", ["policy.generation.trtllm.mode=server",
                                                 f"policy.generation.trtllm.url={server.url}",
                                                 f"weight_sync.backend={transport}"],
                        steps=2, model_dir=tiny_model_dir, run_dir=tmp_path / "run")
    assert [r["generation/weight_version"] for r in rows] == [0.0, 1.0]


def test_a_server_left_with_another_runs_weights_is_reloaded_from_the_model(server, context, reference,
                                                                            tiny_model_dir):
    """trtllm-serve cannot say which weights it holds: the module's server has been synced above, and a new
    run's backend first loads policy.model_name's files into it (reload_on_start), so it samples the
    model's own weights again; without that it would not."""
    from safetensors.torch import load_file

    stale = client(context, server.url, reload_on_start=False)
    stale.update_weights(perturbed_policy(context, 9, 0.05).named_weights(), version=5)  # another run's last weights
    original = [item for f in sorted(tiny_model_dir.glob("*.safetensors")) for item in load_file(str(f)).items()]
    reference.load_tensors(original, version=0)
    sampling = SamplingParams(max_new_tokens=5, seed=3)
    assert any(tokens != w_tokens or logprobs != pytest.approx(w_logprobs, abs=1e-3)
               for (tokens, logprobs, _), (w_tokens, w_logprobs, _) in zip(
                   response_rows(stale.generate(token_rows(PROMPTS), sampling)), expected(reference, PROMPTS, sampling)))
    fresh = client(context, server.url)  # reload_on_start=True: the default
    for (tokens, logprobs, _), (w_tokens, w_logprobs, _) in zip(response_rows(fresh.generate(token_rows(PROMPTS), sampling)),
                                                              expected(reference, PROMPTS, sampling)):
        assert tokens == w_tokens
        assert logprobs == pytest.approx(w_logprobs, abs=1e-5)


def test_grpoctl_runs_two_steps_against_the_server(tmp_path, tiny_model_dir, server):
    """The module's server holds weights synced by earlier tests; reload_on_start puts the model's back."""
    result = run_grpoctl("run", "--run-dir", "run", f"policy.model_name={tiny_model_dir}", "grpo.max_num_steps=2",
                         "grpo.val_period=0", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                         "policy.generation.backend=trtllm", "policy.generation.trtllm.mode=server",
                         f"policy.generation.trtllm.url={server.url}", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["token_mult_prob_error"] - 1) < 1e-3 for r in rows)


def test_async_grpo_one_step_off_drains_for_each_update(tmp_path, tiny_model_dir, server):
    """Async GRPO without in-flight updates: the collector generates through the server while the policy
    trains, and each weight update waits for the generation in progress (no pause route is needed)."""
    result = run_grpoctl("run", "--run-dir", "run", f"policy.model_name={tiny_model_dir}", "grpo.max_num_steps=3",
                         "grpo.val_period=0", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                         "policy.generation.backend=trtllm", "policy.generation.trtllm.mode=server",
                         f"policy.generation.trtllm.url={server.url}", "grpo.async_grpo.enabled=true",
                         "grpo.async_grpo.max_trajectory_age_steps=1", "loss_fn.use_importance_sampling_correction=true",
                         cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    versions = [r["generation/weight_version"] for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3] and versions[0] == 0 and versions[-1] >= 1
    assert all(step - 1 - version <= 1 for step, version in zip((1, 2, 3), versions))  # at most one step old
