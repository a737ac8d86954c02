"""The trtllm backend in engine mode, and grpo-sdk's worker extension, against a FAKE ``tensorrt_llm``
(tests/engine_fakes/fake_tensorrt_llm.py: the names and fields of TensorRT-LLM's API as read in its
source, running no engine).

What these tests prove: the adapter constructs ``AsyncLLM`` as NeMo-RL and verl do (PyTorch backend,
Ray orchestrator, grpo-sdk's extension, KvCacheConfig), asks for PROCESSED logprobs with one
``SamplingParams`` per row (its own seed, ``logprobs=1``, the stop token kept), reads TensorRT-LLM's
``{token_id: Logprob}`` entries, routes weight commands to the extension through ``collective_rpc``
and refuses a worker that did not take an update, and releases/resumes memory with the tags verl
uses; and that the extension sends upstream payloads to upstream's ``update_weights`` and runs
grpo-sdk commands inside a control action through ``model_loader.reload(..., allow_partial_loading=True)``
then the finalise step, loading real tensors into a real torch module. What they do not prove: that
TensorRT-LLM accepts these calls or behaves so (not installable here; benchmarks/gpu/check_trtllm.py
is the check on a real engine), nor anything about CUDA IPC (no GPU here).
"""

from __future__ import annotations

import pytest
import torch
from engine_fakes import fake_tensorrt_llm as fake

from grpo_sdk.backends.trtllm.config import TrtllmConfig, check_options
from grpo_sdk.backends.trtllm.generation import TrtllmGeneration
from grpo_sdk.backends.trtllm.refit import ALL_TAGS, command
from grpo_sdk.config.loading import load_config
from grpo_sdk.plugins import GenerationInput, GrpoSdkError, PluginError, SamplingParams
from grpo_sdk.plugins.tensors import write_weights



def tiny_module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


@pytest.fixture
def trt(monkeypatch):
    module = fake.install(monkeypatch)
    monkeypatch.setattr(fake.AsyncLLM, "model_factory", staticmethod(tiny_module))
    monkeypatch.setattr(fake.AsyncLLM, "workers", 2)
    return module


def engine(context, **options):
    generation = TrtllmGeneration(TrtllmConfig(mode="engine", **options), context)
    return generation, fake.AsyncLLM.instances[-1]


def test_the_engine_is_built_as_nemo_rl_and_verl_build_it(trt, context):
    _, llm = engine(context, gpu_memory_utilization=0.4, max_batch_size=32,
                    llm_kwargs={"kv_cache_config": {"max_tokens": 4096}, "sampler_type": "TorchSampler"})
    kw = llm.kwargs
    assert kw["backend"] == "pytorch" and kw["orchestrator_type"] == "ray"
    assert kw["ray_worker_extension_cls"] == "grpo_sdk.backends.trtllm.worker_extension.GrpoWorkerExtension"
    assert kw["kv_cache_config"] == fake.KvCacheConfig(free_gpu_memory_fraction=0.4, enable_block_reuse=True,
                                                       max_tokens=4096)
    assert kw["max_seq_len"] == kw["max_input_len"] == context.config.policy.max_total_sequence_length
    assert kw["max_batch_size"] == 32 and kw["sampler_type"] == "TorchSampler" and kw["model"] == context.model_path
    assert "max_num_tokens" not in kw  # unset options stay TensorRT-LLM's defaults
    assert llm.set_up  # setup_async awaited on the engine's loop


def test_generate_asks_for_processed_logprobs_per_row_and_reads_them(trt, context):
    generation, llm = engine(context)
    prompts = GenerationInput(input_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]),
                              attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    out = generation.generate(prompts, SamplingParams(max_new_tokens=4, seed=5, stop_token_ids=(9,)))
    calls = [c for name, c in llm.calls if name == "generate_async"]
    assert [c["inputs"] for c in calls] == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9]}]
    params = [c["sampling_params"] for c in calls]
    assert all(p.logprobs_mode is fake.LogprobMode.PROCESSED and p.logprobs == 1 and p.detokenize is False
               and p.include_stop_str_in_output and p.top_k == 0 and p.stop_token_ids == [9] for p in params)
    assert [p.seed for p in params] == [5 * 1_000_003, 5 * 1_000_003 + 1]
    assert out.response_lengths.tolist() == [3, 4]  # row 0 stops at 9 (kept), row 1 runs to the limit
    assert out.response_ids[0, :3].tolist() == [7, 8, 9] and out.response_ids[1].tolist() == [10, 11, 12, 13]
    assert out.truncated.tolist() == [False, True]
    assert out.logprobs[1].tolist() == pytest.approx([-0.5, -0.51, -0.52, -0.53])


def test_weights_reach_every_worker_through_the_extension_and_are_checked(trt, context):
    generation, llm = engine(context)
    new = {name: torch.full_like(t, 0.25) for name, t in tiny_module().state_dict().items()}
    generation.update_weights(new.items(), version=3)  # CPU tensors: a file, the load_file command
    assert generation.weight_version == 3
    for worker in llm.worker_objects:
        assert all(torch.equal(worker.engine.model_engine.model.state_dict()[n], t) for n, t in new.items())
        assert worker.engine.reloads[-1][1] is True  # allow_partial_loading
        assert worker.engine.control_actions == ["grpo_refit"] and worker.engine.prefix_resets == 1
    rpc = [c for name, c in llm.calls if name == "collective_rpc"]
    assert rpc[-1]["method"] == "grpo_refit" and rpc[-1]["args"][0]["op"] == "load_file"

    # A worker whose finalise does not happen (its version stays) is refused, naming what it said.
    stale = llm.worker_objects[1]
    stale._grpo_receiver().finalize = lambda version: None
    original = stale._grpo_receiver()._finish
    stale._grpo_receiver()._finish = lambda body, count: original({**body, "version": 3}, count)
    with pytest.raises(GrpoSdkError, match=r"engine worker 1 did not take the weight update \(load_file\).*"
                                           r"'version': 3.*expected version 4"):
        generation.update_weights(new.items(), version=4)
    assert generation.weight_version == 3


def test_the_extension_sends_upstream_payloads_upstream(trt, context, tmp_path):
    generation, llm = engine(context)
    worker = llm.worker_objects[0]
    worker.update_weights({"GPU-FAKE-0": "aGFuZGxlcw=="})
    worker.update_weights(None)
    assert worker.engine.upstream_updates == [{"GPU-FAKE-0": "aGFuZGxlcw=="}, None]
    assert worker.grpo_device_uuid() == "GPU-FAKE-0"
    # A grpo-sdk command through the same route trtllm-serve calls: loads and finalises.
    path = tmp_path / "w.safetensors"
    write_weights([("0.bias", torch.ones(4))], path)
    reply = worker.update_weights(command("load_file", path=str(path), version=7, last=True))
    assert reply == {"op": "load_file", "version": 7, "tensors": 1}
    assert torch.equal(worker.engine.model_engine.model.state_dict()["0.bias"], torch.ones(4))
    with pytest.raises(KeyError, match="no weights"):
        write_weights([("nope", torch.ones(1))], path)
        worker.update_weights(command("load_file", path=str(path), version=8, last=True))


def test_release_after_generation_and_resume_before_the_next(trt, context):
    generation, llm = engine(context, enable_sleep=True)
    assert llm.kwargs["enable_sleep"] is True
    generation.finish_generation()
    assert ("release", {"tags": list(ALL_TAGS)}) in llm.calls
    resets = [c for name, c in llm.calls if name == "collective_rpc" and c["method"] == "reset_prefix_cache"]
    assert resets  # the prefix index is dropped before the memory (NeMo-RL does the same)
    prompts = GenerationInput(input_ids=torch.tensor([[5, 6]]), attention_mask=torch.tensor([[1, 1]]))
    generation.generate(prompts, SamplingParams(max_new_tokens=2))  # resumes first
    assert [name for name, _ in llm.calls if name in ("release", "resume")] == ["release", "resume"]


def test_engine_mode_check_needs_a_gpu_even_with_tensorrt_llm_installed(trt, registry, tiny_model_dir):
    cfg = load_config(None, [f"policy.model_name={tiny_model_dir}"], registry)
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(PluginError, match="tensorrt_llm is installed but no NVIDIA GPU"):
        check_options(cfg, TrtllmConfig(mode="engine"), registry)


def test_broadcast_commands_reach_every_worker_and_a_short_count_is_refused(trt, context):
    """join/receive go to the extension through collective_rpc with the transport's fields; a sync's
    last call must find every worker holding the version and every tensor of the sync's calls. (The
    group itself is not formed here: both ends would be in this process; the stand-in test forms it.)"""
    generation, llm = engine(context, tensor_parallel_size=2)  # the fake runs two workers
    seen = []
    for worker in llm.worker_objects:
        receiver = worker._grpo_receiver()
        receiver._join = lambda body: seen.append(("join", body["rank_offset"], body["world_size"])) or 0
        receiver._receive = lambda body, receiver=receiver: receiver._finish(body, len(body["tensors"]))
        receiver.finalize = lambda version: None
    generation.join_broadcast(master_address="127.0.0.1", master_port=1234, rank_offset=1, world_size=3,
                              group_name="g", backend="gloo")
    assert seen == [("join", 1, 3)] * 2 and generation.broadcast_ranks() == 2
    generation.receive_broadcast([("a", (2, 2), "float32")], group_name="g", version=1, last=False)
    generation.receive_broadcast([("b", (2,), "bfloat16"), ("c", (1,), "float32")], group_name="g", version=1,
                                 last=True)
    assert generation.weight_version == 1
    sent = [c["args"][0] for name, c in llm.calls if name == "collective_rpc" and c["method"] == "grpo_refit"]
    assert sent[-1]["tensors"] == [["b", [2], "bfloat16"], ["c", [1], "float32"]] and sent[-1]["last"] is True
    short = llm.worker_objects[0]._grpo_receiver()
    short._receive = lambda body: short._finish(body, len(body["tensors"]) - 1)  # one tensor lost
    with pytest.raises(GrpoSdkError, match=r"engine worker 0 did not take the weight update \(receive\)"):
        generation.receive_broadcast([("a", (2, 2), "float32")], group_name="g", version=2, last=True)
    assert generation.weight_version == 1 and generation.pending_tensors == 0
