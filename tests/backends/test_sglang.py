"""The SGLang backend in server mode, over real HTTP, against the STAND-IN server
(tests/engine_servers/sglang_server.py: SGLang 0.5.23's routes and shapes on a real tiny GPT-2).

What these tests prove: the adapter speaks SGLang's HTTP protocol as written in SGLang's source
(request fields, reply parsing, the flattened-bucket tensor payload, the weight-update group
routes, release/resume, pause/continue, version checks), the tokens and logprobs it returns are
the model's (they match the hf policy's), every weight path changes what is sampled, and every
failure is a clear error within a deadline. What they do not prove: that a real SGLang server
behaves so (no SGLang runs here: its CPU kernels are not on PyPI); benchmarks/gpu/check_sglang.py
is that check, for a GPU machine.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

from helpers import prompt_batch, run_grpoctl, train_batch
from engine_servers.base import start_server
from grpo_sdk.core.errors import GrpoSdkError


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    process = start_server("sglang_server", tiny_model_dir, "--memory-saver")
    yield process
    process.stop()


def post(server, path, body):
    from grpo_sdk.plugins.toolkit import HTTPClient

    return HTTPClient(server.url, timeout_s=30, what="test").post(path, body)


@pytest.fixture
def faults(server):
    """Fault injection on the stand-in, all undone after the test."""
    yield lambda **body: post(server, "/_standin/fault", body)
    post(server, "/_standin/fault", {"reset": True})


def make(registry, model_dir, url, *overrides):
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.models import load_tokenizer

    cfg = load_config(None, [f"policy.model_name={model_dir}", "loss_fn.reference_policy_kl_penalty=0",
                             "policy.generation.backend=sglang", f"policy.generation.sglang.url={url}", *overrides],
                      registry)
    context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                         device="cpu", seed=0, needs_reference=False)
    generation = registry.load_impl("generation", "sglang")(cfg.policy.generation.structured_blocks["sglang"], context)
    return generation, HFPolicy(None, context), load_tokenizer(str(model_dir)), cfg


@pytest.fixture(scope="module")
def setup(registry, tiny_model_dir, server):
    generation, policy, tokenizer, cfg = make(registry, tiny_model_dir, server.url, "policy.optimizer.lr=0.05",
                                              "policy.generation.temperature=0.8")
    yield generation, policy, tokenizer, cfg
    generation.shutdown()


def policy_greedy(policy, inputs, steps, eos):
    """The policy's own greedy continuation, token by token."""
    expected = []
    with torch.no_grad():
        for row, mask in zip(inputs.input_ids, inputs.attention_mask):
            seq = row[mask.bool()].tolist()
            for _ in range(steps):
                seq.append(int(policy.model(torch.tensor([seq])).logits[0, -1].argmax()))
                if seq[-1] == eos:
                    break
            expected.append(seq[int(mask.sum()):])
    return expected


def greedy(generation, inputs, steps):
    from grpo_sdk.core.records import SamplingParams

    out = generation.generate(inputs, SamplingParams(max_new_tokens=steps, temperature=1e-5))
    return out, [r[:n] for r, n in zip(out.response_ids.tolist(), out.response_lengths.tolist())]


def train_step(policy, cfg, inputs, out, seed):
    from grpo_sdk.algorithms.loss import ClippedPGLoss

    batch = train_batch(inputs, out)
    batch.advantages = torch.randn(len(out.response_ids), 1, generator=torch.Generator().manual_seed(seed)
                                   ).expand_as(batch.token_mask).contiguous()
    policy.train(batch, ClippedPGLoss(cfg.loss_fn))


# --- sampling -------------------------------------------------------------------------------------


def test_samples_stop_tokens_and_logprobs_match_the_policy(setup):
    """Token ids in, token ids and logprobs out: stop tokens end a row (and are in it), padding is
    the pad id, and the logprobs are the policy's of the sampled tokens at that temperature."""
    from grpo_sdk.core.records import SamplingParams

    generation, policy, tokenizer, cfg = setup
    inputs = prompt_batch(tokenizer, ["1>", "12345>", "987>", "55555>"] * 2)
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123")))
    out = generation.generate(inputs, SamplingParams(max_new_tokens=8, temperature=0.8, stop_token_ids=digits))
    stops = set(digits) | {tokenizer.eos_token_id}
    for row, length, truncated in zip(out.response_ids.tolist(), out.response_lengths.tolist(), out.truncated.tolist()):
        first = next((i for i, t in enumerate(row[:length]) if t in stops), None)
        assert (first is None and truncated and length == 8) or (first == length - 1 and not truncated)
        assert all(t == tokenizer.pad_token_id for t in row[length:])
    batch = train_batch(inputs, out)
    mask = batch.token_mask.bool()
    torch.testing.assert_close(policy.logprobs(batch)[mask], batch.generation_logprobs[mask], atol=1e-4, rtol=0)


def test_a_seeded_call_repeats_and_seeds_each_row_its_own_way(setup):
    from grpo_sdk.core.records import SamplingParams

    generation, policy, tokenizer, cfg = setup
    inputs = prompt_batch(tokenizer, ["4321>"] * 6)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    first, again = generation.generate(inputs, params), generation.generate(inputs, params)
    assert torch.equal(first.response_ids, again.response_ids)
    assert len({tuple(r) for r in first.response_ids.tolist()}) > 1  # same prompt, per-row seeds


# --- weight paths ---------------------------------------------------------------------------------


def test_update_weights_in_flattened_buckets_changes_what_is_sampled(registry, tiny_model_dir, server):
    """The inprocess path: several /update_weights_from_tensor calls (tiny buckets), then the server
    samples the policy's greedy tokens and reports the version."""
    generation, policy, tokenizer, cfg = make(registry, tiny_model_dir, server.url, "policy.optimizer.lr=0.05",
                                              "policy.generation.sglang.update_bucket_mb=0.02")
    inputs = prompt_batch(tokenizer, ["12345>", "97531>"] * 2)
    before, _ = greedy(generation, inputs, 6)
    train_step(policy, cfg, inputs, before, seed=1)
    from grpo_sdk.plugins.toolkit import HTTPClient

    counts = HTTPClient(server.url, timeout_s=10, what="test").get("/_standin/counts")
    start = counts.get("/update_weights_from_tensor", 0)
    generation.update_weights(policy.named_weights(), version=5)
    counts = HTTPClient(server.url, timeout_s=10, what="test").get("/_standin/counts")
    assert counts["/update_weights_from_tensor"] - start > 1  # more than one bucket
    out, got = greedy(generation, inputs, 6)
    assert out.weight_version == 5 and generation.weight_version == 5
    assert got == policy_greedy(policy, inputs, 6, tokenizer.eos_token_id)


def test_load_weights_reads_a_per_version_directory(setup, tmp_path):
    """The disk path: /update_weights_from_disk of a directory holding the transport's file; the
    directory is gone afterwards, the file is not."""
    from grpo_sdk.plugins.tensors import write_weights

    generation, policy, tokenizer, cfg = setup
    inputs = prompt_batch(tokenizer, ["2468>", "1357>"])
    before, _ = greedy(generation, inputs, 6)
    train_step(policy, cfg, inputs, before, seed=2)
    path = tmp_path / "weights_v7.safetensors"
    write_weights(policy.named_weights(), path)
    generation.load_weights(str(path), version=7)
    assert path.exists() and not (tmp_path / "sglang-weights-v7").exists()
    out, got = greedy(generation, inputs, 6)
    assert out.weight_version == 7 and got == policy_greedy(policy, inputs, 6, tokenizer.eos_token_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_receive_broadcast_through_sglangs_weight_update_group(setup):
    """The collective path, driven by hand (this process is rank 0, as the collective transport's
    driver is): /init_weights_update_group while rank 0 joins, then /update_weights_from_distributed
    while rank 0 broadcasts each tensor, in two batches, the last flushing the cache."""
    import torch.distributed as dist

    from grpo_sdk.plugins.toolkit import join_process_group, leave_process_group

    generation, policy, tokenizer, cfg = setup
    inputs = prompt_batch(tokenizer, ["8642>", "3>"])
    before, _ = greedy(generation, inputs, 6)
    train_step(policy, cfg, inputs, before, seed=3)
    port, errors = free_port(), []

    def in_thread(fn, **kwargs):
        def run():
            try:
                fn(**kwargs)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    assert generation.broadcast_ranks() == 1
    joining = in_thread(generation.join_broadcast, master_address="127.0.0.1", master_port=port, rank_offset=1,
                        world_size=2, group_name="sglang-test", backend="gloo")
    group = join_process_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2, rank=0,
                               group_name="sglang-test", timeout_s=60)
    joining.join(60)
    assert not errors, errors
    named = [(n, t.detach().contiguous()) for n, t in policy.named_weights()]
    try:
        for batch, last in ((named[:3], False), (named[3:], True)):
            receiving = in_thread(generation.receive_broadcast,
                                  tensors=[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in batch],
                                  group_name="sglang-test", version=9, last=last)
            for _, tensor in batch:
                dist.broadcast(tensor, src=0, group=group)
            receiving.join(60)
            assert not errors, errors
    finally:
        leave_process_group(group)
    out, got = greedy(generation, inputs, 6)
    assert out.weight_version == 9 and got == policy_greedy(policy, inputs, 6, tokenizer.eos_token_id)


def test_a_server_holding_an_earlier_runs_weights_is_reloaded_or_refused(registry, tiny_model_dir, server):
    """A server outlives runs: one whose weight_version is no longer its launch value reloads
    policy.model_name first (reload_on_start) or is refused."""
    from grpo_sdk.plugins import PluginError
    from grpo_sdk.plugins.toolkit import HTTPClient

    generation, policy, tokenizer, cfg = make(registry, tiny_model_dir, server.url)
    generation.update_weights([(n, torch.zeros_like(t)) for n, t in policy.named_weights()], version=21)
    with pytest.raises(PluginError, match="holds weights of version '21' from an earlier run"):
        make(registry, tiny_model_dir, server.url, "policy.generation.sglang.reload_on_start=false")
    fresh, policy, tokenizer, cfg = make(registry, tiny_model_dir, server.url)
    assert HTTPClient(server.url, timeout_s=10, what="test").get("/model_info")["weight_version"] == "0"
    inputs = prompt_batch(tokenizer, ["12345>", "5>"])
    out, got = greedy(fresh, inputs, 6)
    assert out.weight_version == 0 and got == policy_greedy(policy, inputs, 6, tokenizer.eos_token_id)


# --- colocation, pausing --------------------------------------------------------------------------


def test_colocated_offload_releases_after_generation_and_resumes_before(registry, tiny_model_dir, server):
    """The stand-in refuses to generate while released, so a sample after prepare_for_generation
    proves the adapter resumed first; a direct /generate in between proves it had released."""
    from grpo_sdk.core.records import SamplingParams

    generation, policy, tokenizer, cfg = make(registry, tiny_model_dir, server.url,
                                              "policy.generation.sglang.needs_offload=true")
    inputs = prompt_batch(tokenizer, ["12>"])
    generation.finish_generation()
    with pytest.raises(GrpoSdkError, match="/generate.*released"):
        post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    generation.prepare_for_generation()
    assert generation.generate(inputs, SamplingParams(max_new_tokens=2)).response_ids.shape[0] == 1
    generation.finish_generation()
    generation.update_weights(policy.named_weights(), version=3)  # resumes first: a released engine has no weights
    assert generation.generate(inputs, SamplingParams(max_new_tokens=2)).weight_version == 3


def test_pause_drains_the_running_call_and_holds_new_ones_until_resumed(setup):
    from grpo_sdk.core.records import SamplingParams

    generation, policy, tokenizer, cfg = setup
    inputs = prompt_batch(tokenizer, ["123>"] * 4)
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    done = []
    running = threading.Thread(target=lambda: done.append(generation.generate(inputs, params)))
    running.start()
    time.sleep(0.2)
    generation.pause_generation(keep_in_flight=False)
    assert done, "pause returned before the running generate finished"
    waiting = threading.Thread(target=lambda: done.append(generation.generate(inputs, params)))
    waiting.start()
    time.sleep(0.5)
    assert len(done) == 1  # held while paused
    generation.resume_generation(recompute_kv_cache=False)
    waiting.join(60)
    running.join(60)
    assert len(done) == 2


@pytest.mark.parametrize("recompute", [False, True], ids=["in_place", "retract"])
def test_an_update_in_flight_lands_between_decode_steps_with_per_token_versions(registry, tiny_model_dir, server,
                                                                                 faults, recompute):
    """pause_generation(keep_in_flight=True) -> /pause_generation in_place (or retract with
    recompute), an update while the batch decodes, /continue_generation: the rows carry both
    versions (meta_info.weight_versions spans), and each token's logprob is that of the weights
    that sampled it. With retract the later tokens were sampled from a recomputed cache, so they
    are exactly the new policy's logprobs; in place they read the old weights' cache, so only the
    tokens before the update are checked against a policy."""
    from grpo_sdk.core.records import SamplingParams

    generation, policy, tokenizer, cfg = make(
        registry, tiny_model_dir, server.url, "policy.optimizer.lr=0.05",
        f"grpo.async_grpo.recompute_kv_cache_after_weight_updates={str(recompute).lower()}")
    inputs = prompt_batch(tokenizer, ["12>", "345>", "6>", "7890>"] * 2)
    start_version = generation.weight_version
    warm = generation.generate(inputs, SamplingParams(max_new_tokens=6))
    old = {n: t.detach().clone() for n, t in policy.named_weights()}
    train_step(policy, cfg, inputs, warm, seed=4)
    faults(step_delay_s=0.05)
    done = []
    running = threading.Thread(target=lambda: done.append(generation.generate(inputs, SamplingParams(
        max_new_tokens=40))))
    running.start()
    time.sleep(0.5)
    generation.pause_generation(keep_in_flight=True)
    assert not done  # returned at once, the batch still decoding
    generation.update_weights(policy.named_weights(), version=start_version + 1)
    generation.resume_generation(recompute_kv_cache=recompute)
    running.join(60)
    out = done[0]
    assert out.token_weight_versions is not None and out.weight_version == start_version
    versions = out.token_weight_versions
    assert set(versions.unique().tolist()) == {start_version, start_version + 1}
    valid = torch.arange(versions.shape[1])[None] < out.response_lengths[:, None]
    assert torch.all((versions[:, 1:] >= versions[:, :-1]) | ~valid[:, 1:])  # one switch, forward in time
    assert torch.all(versions[~valid] == start_version)  # padding: the oldest
    batch = train_batch(inputs, out)
    mask = batch.token_mask.bool()
    prompt_width = inputs.input_ids.shape[1]
    token_versions = torch.cat([torch.full(inputs.input_ids.shape, -1), versions], 1)
    new_logprobs = policy.logprobs(batch)
    with torch.no_grad():
        for name, tensor in policy.named_weights():
            tensor.copy_(old[name])
    old_logprobs = policy.logprobs(batch)
    before = mask & (token_versions == start_version)
    torch.testing.assert_close(old_logprobs[before], batch.generation_logprobs[before], atol=1e-4, rtol=0)
    if recompute:
        after = mask & (token_versions == start_version + 1)
        assert after.any() and prompt_width > 0
        torch.testing.assert_close(new_logprobs[after], batch.generation_logprobs[after], atol=1e-4, rtol=0)


def test_in_flight_updates_need_server_mode(registry, tiny_model_dir):
    from helpers import config_problems

    problems = config_problems(registry, f"policy.model_name={tiny_model_dir}", "policy.generation.backend=sglang",
                               "policy.generation.sglang.mode=engine", "grpo.async_grpo.enabled=true",
                               "grpo.async_grpo.schedule=newest", "grpo.async_grpo.in_flight_weight_updates=true")
    assert "sglang.Engine has no pause_generation" in problems["policy.generation.sglang.mode"]


# --- failures -------------------------------------------------------------------------------------


def test_a_version_the_server_did_not_take_is_an_error(setup, faults):
    generation, policy, tokenizer, cfg = setup
    faults(ignore_weight_version=True)
    with pytest.raises(GrpoSdkError, match="did not take the update"):
        generation.update_weights(policy.named_weights(), version=11)


def test_an_http_error_names_the_route_and_shows_the_servers_message(setup, faults):
    generation, policy, tokenizer, cfg = setup
    faults(route="/update_weights_from_tensor", status=500)
    with pytest.raises(GrpoSdkError, match=r"POST http://127\.0\.0\.1:\d+/update_weights_from_tensor failed: HTTP "
                                           r"500.*stand-in fault injected"):
        generation.update_weights(policy.named_weights(), version=12)


def test_no_server_is_a_clear_error_within_the_deadline(registry, tiny_model_dir):
    start = time.monotonic()
    with pytest.raises(GrpoSdkError, match=r"is the server running\? \(policy\.generation\.sglang\.url\)"):
        make(registry, tiny_model_dir, f"http://127.0.0.1:{free_port()}", "policy.generation.sglang.control_timeout_s=5")
    assert time.monotonic() - start < 10


def test_a_server_that_dies_mid_run_is_a_clear_error_within_the_deadline(registry, tiny_model_dir):
    from grpo_sdk.core.records import SamplingParams

    doomed = start_server("sglang_server", tiny_model_dir)
    try:
        generation, policy, tokenizer, cfg = make(registry, tiny_model_dir, doomed.url,
                                                  "policy.generation.sglang.request_timeout_s=10")
        doomed.process.kill()
        doomed.process.wait(10)
        start = time.monotonic()
        with pytest.raises(GrpoSdkError, match="/generate.*is the server running"):
            generation.generate(prompt_batch(tokenizer, ["1>"]), SamplingParams(max_new_tokens=2))
        assert time.monotonic() - start < 15
    finally:
        doomed.stop()


# --- config and the CLI ---------------------------------------------------------------------------


def test_config_check_refuses_what_sglang_cannot_do(registry, tiny_model_dir):
    from helpers import config_problems

    problems = config_problems(registry, f"policy.model_name={tiny_model_dir}", "policy.generation.backend=sglang",
                               "policy.generation.top_p=0.9", "policy.generation.sglang.needs_offload=true",
                               "policy.generation.colocated.enabled=false")
    assert "policy.generation.sglang.url" in problems
    assert "before top-p renormalises" in problems["policy.generation.top_p"]
    assert "colocated.enabled=true" in problems["policy.generation.sglang.needs_offload"]


def test_engine_mode_without_sglang_exits_3_with_the_install_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    result = run_grpoctl("run", "--run-dir", "run", "policy.model_name=builtin:tiny-gpt2",
                         "policy.generation.backend=sglang", "policy.generation.sglang.mode=engine", cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "pip install 'grpo-sdk[sglang]'" in result.stderr


def test_the_contract_kit_protocols_hold():
    from grpo_sdk.backends.sglang.generation import SGLangGeneration
    from grpo_sdk.testing import check_light, check_protocol, check_spec

    assert check_spec("generation", "sglang").name == "sglang"
    check_light("generation", "sglang")  # raises when spec or config imports torch or an engine
    assert check_protocol("generation", "sglang") is SGLangGeneration


@pytest.mark.parametrize("transport", ["inprocess", "disk", "collective"])
def test_the_contract_kit_trains_through_the_server(tmp_path, tiny_model_dir, server, transport):
    """Two GRPO steps of the built-in recipe through the real trainer with the stand-in generating,
    the weights synced by ``transport`` (collective: the transport drives SGLang's own update group,
    this process being rank 0); the kit's probe then checks the server samples the synced weights
    (version and logprobs)."""
    from grpo_sdk.plugins.toolkit import HTTPClient
    from grpo_sdk.testing import run_training

    route = {"inprocess": "/update_weights_from_tensor", "disk": "/update_weights_from_disk",
             "collective": "/update_weights_from_distributed"}[transport]
    counts = HTTPClient(server.url, timeout_s=10, what="test")
    before = counts.get("/_standin/counts").get(route, 0)
    rows = run_training("generation", "sglang", [f"policy.generation.sglang.url={server.url}",
                                                 f"weight_sync.backend={transport}"],
                        steps=2, model_dir=tiny_model_dir, run_dir=tmp_path / "run")
    assert [r["generation/weight_version"] for r in rows] == [0.0, 1.0]
    assert counts.get("/_standin/counts")[route] > before  # the weights took SGLang's route for this transport


def test_grpoctl_runs_two_steps_against_the_server(tmp_path, tiny_model_dir, server):
    result = run_grpoctl("run", "--run-dir", "run", f"policy.model_name={tiny_model_dir}", "grpo.max_num_steps=2",
                         "grpo.val_period=0", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                         "policy.generation.backend=sglang", f"policy.generation.sglang.url={server.url}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["token_mult_prob_error"] - 1) < 1e-3 for r in rows)


def test_async_grpo_with_in_flight_updates_runs_against_the_server(tmp_path, tiny_model_dir, server):
    """Async GRPO (newest schedule, one step off) refitting the server in flight through the real
    collector: the run finishes and every refit went through /pause_generation (in_place: requests kept
    in flight) + /continue_generation. Whether an update actually met a running request is timing;
    the test above places one deterministically."""
    from grpo_sdk.plugins.toolkit import HTTPClient

    counts = HTTPClient(server.url, timeout_s=10, what="test")
    before = counts.get("/_standin/counts")
    result = run_grpoctl("run", "--run-dir", "run", f"policy.model_name={tiny_model_dir}", "grpo.max_num_steps=3",
                         "grpo.val_period=0", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                         "grpo.async_grpo.enabled=true", "grpo.async_grpo.schedule=newest",
                         "grpo.async_grpo.in_flight_weight_updates=true", "loss_fn.use_importance_sampling_correction=true",
                         "policy.generation.backend=sglang", f"policy.generation.sglang.url={server.url}",
                         # a draining pause would use this mode; an in-flight one in_place (no recompute)
                         "policy.generation.sglang.pause_generation_mode=retract", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    after = counts.get("/_standin/counts")
    refits = after.get("/pause_generation", 0) - before.get("/pause_generation", 0)
    assert refits >= 2 and after["/continue_generation"] - before.get("/continue_generation", 0) == refits
    assert after["pause mode in_place"] - before.get("pause mode in_place", 0) == refits  # kept in flight
