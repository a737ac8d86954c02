"""The megatron policy under tensor parallelism (TP = 2) and data parallelism (DP = 2) on two gloo
ranks on CPU: the same logprobs, train step and exported weights as one process, and an exact resume
from per-shard checkpoints.

Each configuration runs in freshly spawned processes (Megatron's parallel state is process-global):
the worker plays the runtime (it joins the gloo group, then builds the policy with that rank and
world size) and writes its results to a file; the tests compare the files. The tiny Llama has an odd
vocabulary (127), so TP = 2 pads it to 128 and shard 1 holds a padded column the logprobs must mask.
"""

from __future__ import annotations

import copy
import os
import socket
import time

import pytest

from helpers import MEGATRON_LANE

pytestmark = MEGATRON_LANE

VOCAB = 127
TOL = 1e-5
WORKER_TIMEOUT_S = 120
OVERRIDES = ("policy.train_micro_batch_size=1", "policy.logprob_batch_size=2", "policy.optimizer.lr=0.01",
             "policy.optimizer.eps=0.1", "policy.max_grad_norm=0.5", "grpo.num_prompts_per_step=2",
             "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=4", "policy.scheduler.warmup_steps=2",
             "loss_fn.reference_policy_kl_penalty=0.05")
# Adam's eps=0.1 makes the first step linear in the gradient, so weights compare the gradients (see
# test_megatron.test_policy_train_step_equals_hf_policy for why a tiny eps would not).
SAMPLINGS = {
    "plain": {"temperature": 1.0, "top_k": None, "top_p": 1.0},
    "top_k": {"temperature": 0.7, "top_k": 20, "top_p": 1.0},
    "top_p": {"temperature": 0.7, "top_k": None, "top_p": 0.8},
    "top_k_top_p": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
}
# "two_steps": two optimizer steps of 2 rows each (one row per data-parallel replica).
TRAIN_SAMPLINGS = {"plain": (), "two_steps": ("policy.train_global_batch_size=2",),
                   "top_k": ("policy.generation.temperature=0.7", "policy.generation.top_k=20")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_llama(path) -> str:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_dropout=0.0, initializer_range=0.1)
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # norms start at 1: perturb every tensor so a misplaced shard shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    return str(path)


def _batch(model_dir: str, seed: int, rows: int = 4, prompt: int = 6, response: int = 5):
    """Left-padded random prompts + right-padded greedy responses of the model, random advantages.

    Greedy tokens are inside every top-k / top-p nucleus, so a filtered training step has finite
    logprobs on every response token (a random token outside top-k has logprob -inf, loss nan).
    """
    import torch
    import transformers

    from grpo_sdk.core.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, prompt + response), generator=g)
    prompt_lens = torch.randint(2, prompt + 1, (rows,), generator=g)
    response_lens = torch.randint(1, response + 1, (rows,), generator=g)
    pos = torch.arange(prompt + response)
    prompt_mask = (pos[None] >= prompt - prompt_lens[:, None]) & (pos[None] < prompt)
    response_mask = (pos[None] >= prompt) & (pos[None] < prompt + response_lens[:, None])
    attention = (prompt_mask | response_mask).long()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for end in range(prompt, prompt + response):
            mask = (prompt_mask | (pos[None] < end) & (pos[None] >= prompt)).long()[:, :end]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids[:, :end] * mask, attention_mask=mask, position_ids=positions).logits
            ids[:, end] = logits[:, -1].argmax(-1)
    return TrainBatch(input_ids=ids * attention, attention_mask=attention, token_mask=response_mask.float(),
                      sample_mask=torch.ones(rows), generation_logprobs=torch.zeros(ids.shape),
                      group_ids=torch.arange(rows) // 2, rewards=torch.zeros(rows),
                      advantages=torch.randn(rows, 1, generator=g).expand_as(response_mask).float().contiguous())


def _context(model_dir, rank: int, world: int, *overrides):
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.plugins.registry import Registry

    cfg = load_config(None, [f"policy.model_name={model_dir}", *OVERRIDES, *overrides], Registry.discover())
    return RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                      device="cpu", seed=0, needs_reference=True, rank=rank, world_size=world)


def _scenario(policy_cls, config, model_dir, rank, world, with_checkpoint, ckpt_dir, batches) -> dict:
    """Logprobs under every sampling, one train step per training sampling, its exported weights and,
    optionally, save -> train -> fresh policy -> load -> train."""
    from grpo_sdk.algorithms.loss import ClippedPGLoss

    def build(*overrides):
        context = _context(model_dir, rank, world, *overrides)
        return context, (policy_cls(config, context) if config is not None else policy_cls(None, context))

    out = {}
    context, policy = build()
    batch = copy.deepcopy(batches[0])
    for name, sampling in SAMPLINGS.items():
        policy.sampling = dict(sampling)
        out[f"logprobs/{name}"] = policy.logprobs(batch)
    if config is not None:
        from grpo_sdk.backends.megatron import parallel

        # Top-p over vocab shards from 2 candidates per shard first: the nucleus is longer, so the
        # candidate count must grow (2 -> 16 -> 64) before the prefix is exact.
        first_try, parallel.TOP_P_CANDIDATES = parallel.TOP_P_CANDIDATES, 2
        policy.sampling = dict(SAMPLINGS["top_p"])
        out["logprobs/top_p_from_2_candidates"] = policy.logprobs(batch)
        parallel.TOP_P_CANDIDATES = first_try
        out["padded_vocab"] = policy.model.embedding.word_embeddings.weight.shape[0] * config.tensor_model_parallel_size
    for name, overrides in TRAIN_SAMPLINGS.items():
        context, policy = build(*overrides)
        loss = ClippedPGLoss(context.config.loss_fn)
        batch = copy.deepcopy(batches[0])
        batch.reference_logprobs = policy.reference_logprobs(batch)
        started = time.perf_counter()
        out[f"train/{name}"] = policy.train(batch, loss)
        out[f"train_seconds/{name}"] = time.perf_counter() - started
        out[f"weights/{name}"] = {k: v.detach().clone() for k, v in policy.named_weights()}
        out[f"logprobs_after/{name}"] = policy.logprobs(batch)
    if with_checkpoint:
        second = copy.deepcopy(batches[1])
        second.reference_logprobs = policy.reference_logprobs(second)
        policy.save_checkpoint(ckpt_dir)
        out["resume/expected"] = policy.train(second, loss)
        expected_weights = dict(policy.named_weights())
        _, fresh = build(*TRAIN_SAMPLINGS["top_k"])
        fresh.load_checkpoint(ckpt_dir)
        out["resume/got"] = fresh.train(second, loss)
        out["resume/max_weight_diff"] = max((t - expected_weights[n]).abs().max().item()
                                            for n, t in fresh.named_weights())
        out["resume/files"] = sorted(os.listdir(ckpt_dir))
    return out


def _worker(rank: int, world: int, port: int, tp: int, model_dir: str, out_dir: str, with_hf: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    batches = torch.load(os.path.join(model_dir, "batches.pt"), weights_only=False)
    # The runtime's part: join the policy group before the policy is built.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    from grpo_sdk.backends.megatron.config import MegatronPolicyConfig
    from grpo_sdk.backends.megatron.policy import MegatronPolicy

    started = time.perf_counter()
    result = _scenario(MegatronPolicy, MegatronPolicyConfig(tensor_model_parallel_size=tp), model_dir, rank, world,
                       with_checkpoint=True, ckpt_dir=os.path.join(out_dir, "ckpt"), batches=batches)
    result["seconds"] = time.perf_counter() - started
    if with_hf:
        from grpo_sdk.backends.hf.policy import HFPolicy

        result["hf"] = _scenario(HFPolicy, None, model_dir, rank, world, with_checkpoint=False, ckpt_dir=None,
                                 batches=batches)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _run(model_dir: str, out_dir: str, world: int, tp: int, with_hf: bool = False) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    os.makedirs(out_dir)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, tp, model_dir, out_dir, with_hf)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"world {world}, TP {tp}: worker exit codes {codes} (timeout {WORKER_TIMEOUT_S} s)"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (TP = 1, with the hf policy), TP = 2 on two ranks, DP = 2 (TP = 1) on two ranks, and
    TP = 2 x DP = 2 on four (metrics summed over the DP group only, the grad norm over the TP group only)."""
    root = tmp_path_factory.mktemp("megatron_parallel")
    model_dir = _tiny_llama(root / "llama")
    import torch

    torch.save([_batch(model_dir, seed=3), _batch(model_dir, seed=4)], os.path.join(model_dir, "batches.pt"))
    out, seconds = {}, {}
    for name, world, tp in (("single", 1, 1), ("tp2", 2, 2), ("dp2", 2, 1), ("tp2dp2", 4, 2)):
        started = time.perf_counter()
        out[name] = _run(model_dir, str(root / name), world, tp, with_hf=name == "single")
        seconds[name] = time.perf_counter() - started
    print("wall seconds per configuration (spawn + imports + all scenarios):", seconds)
    batch = torch.load(os.path.join(model_dir, "batches.pt"), weights_only=False)[0]
    attention = batch.attention_mask
    out["keep"] = torch.zeros_like(attention, dtype=torch.bool)
    # The hf policy computes logprobs at response positions only (0 elsewhere); megatron scores every
    # real token: compare where both do.
    out["keep"][:, 1:] = attention[:, 1:].bool() & attention[:, :-1].bool() & batch.token_mask[:, 1:].bool()
    return out


def _logprob_diff(a, b) -> float:
    import torch

    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b)), "a different set of filtered (-inf) tokens"
    assert torch.equal(a[~finite], b[~finite])
    return (a[finite] - b[finite]).abs().max().item()


@pytest.mark.parametrize("config", ["tp2", "dp2", "tp2dp2"])
def test_parallel_logprobs_equal_single_process(runs, config):
    single, ranks = runs["single"][0], runs[config]
    keep = runs["keep"]  # response tokens after a real token: where both policies compute logprobs
    for name in SAMPLINGS:
        hf_diff = _logprob_diff(single["hf"][f"logprobs/{name}"][keep], single[f"logprobs/{name}"][keep])
        for rank, result in enumerate(ranks):
            diff = _logprob_diff(single[f"logprobs/{name}"], result[f"logprobs/{name}"])
            print(f"{config} rank {rank} {name}: max |logprob diff| vs TP=1 {diff:.2e} (TP=1 vs hf {hf_diff:.2e})")
            assert diff <= TOL, (name, rank, diff)
        assert hf_diff <= TOL, (name, hf_diff)
    for rank, result in enumerate(ranks):
        diff = _logprob_diff(single["logprobs/top_p"], result["logprobs/top_p_from_2_candidates"])
        assert diff <= TOL, (rank, diff)
    # TP = 2 pads the odd vocabulary (127) to 128: shard 1's last column is padding, which the logprobs mask.
    assert [r["padded_vocab"] for r in ranks] == [128 if config.startswith("tp2") else VOCAB] * len(ranks)
    # The filters really filter: top-k and top-p leave -inf on some scored tokens, top-p more than top-k.
    masked = {name: (~single[f"logprobs/{name}"].isfinite()).sum().item() for name in SAMPLINGS}
    assert masked["plain"] == 0 and 0 < masked["top_k"] < masked["top_k_top_p"] and masked["top_p"] > 0, masked


@pytest.mark.parametrize("config", ["tp2", "dp2", "tp2dp2"])
def test_parallel_train_step_equals_single_process(runs, config):
    single, ranks = runs["single"][0], runs[config]
    for name in TRAIN_SAMPLINGS:
        expected, hf = single[f"train/{name}"], single["hf"][f"train/{name}"]
        for key in ("loss", "grad_norm", "lr"):
            assert abs(expected[key] - hf[key]) <= TOL, (name, key, expected[key], hf[key])
        weights = single[f"weights/{name}"]
        hf_weights = single["hf"][f"weights/{name}"]
        assert sorted(weights) == sorted(hf_weights)
        for rank, result in enumerate(ranks):
            got = result[f"train/{name}"]
            assert set(got) == set(expected)
            for key in expected:
                assert abs(got[key] - expected[key]) <= TOL * max(1.0, abs(expected[key])), (name, rank, key)
            assert sorted(result[f"weights/{name}"]) == sorted(weights)
            worst = max((result[f"weights/{name}"][n] - t).abs().max().item() for n, t in weights.items())
            assert all(result[f"weights/{name}"][n].shape == t.shape for n, t in weights.items())
            hf_worst = max((result[f"weights/{name}"][n] - t).abs().max().item() for n, t in hf_weights.items())
            print(f"{config} rank {rank} {name}: loss {got['loss']:.6f} (TP=1 {expected['loss']:.6f}), grad_norm "
                  f"{got['grad_norm']:.6f} (TP=1 {expected['grad_norm']:.6f}); max weight diff vs TP=1 {worst:.2e}, "
                  f"vs hf {hf_worst:.2e}; train {result[f'train_seconds/{name}']:.2f} s")
            assert worst <= 1e-6 and hf_worst <= 1e-6, (name, rank, worst, hf_worst)
            after = _logprob_diff(single[f"logprobs_after/{name}"], result[f"logprobs_after/{name}"])
            assert after <= TOL, (name, rank, after)
        assert expected["grad_norm"] > 0.5  # max_grad_norm=0.5 clipped: the clipping path ran


def test_parallel_checkpoint_resume_is_exact(runs):
    # The weights as a Hugging Face model directory (whatever the TP size), the optimizer per TP shard.
    hf_files = ["config.json", "model.safetensors"]
    for config, files in (("single", ["optimizer.pt"]), ("tp2", ["optimizer.tp0.pt",
                                                                     "optimizer.tp1.pt"]),
                          ("dp2", ["optimizer.pt"]),
                          ("tp2dp2", ["optimizer.tp0.pt", "optimizer.tp1.pt"])):
        for rank, result in enumerate(runs[config]):
            assert result["resume/files"] == sorted(hf_files + files), (config, result["resume/files"])
            assert result["resume/got"] == result["resume/expected"], (config, rank)
            assert result["resume/max_weight_diff"] == 0.0, (config, rank)
    # The resumed step also matches across configurations (TP = 2 and DP = 2 vs one process).
    expected = runs["single"][0]["resume/expected"]
    for config in ("tp2", "dp2", "tp2dp2"):
        got = runs[config][0]["resume/got"]
        assert abs(got["loss"] - expected["loss"]) <= TOL and abs(got["grad_norm"] - expected["grad_norm"]) <= TOL


def test_refused_parallelism_names_the_key():
    from grpo_sdk.backends.megatron.config import MegatronPolicyConfig
    from grpo_sdk.backends.megatron.policy import check_parallel_sizes

    # The check runs in MegatronPolicy.__init__ before any process group or model is touched.
    for key in ("pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size"):
        with pytest.raises(NotImplementedError, match=f"policy.megatron.{key}=2: not supported"):
            check_parallel_sizes(MegatronPolicyConfig(**{key: 2}), 4)
    with pytest.raises(NotImplementedError, match="policy.megatron.sequence_parallel=true"):
        check_parallel_sizes(MegatronPolicyConfig(tensor_model_parallel_size=2, sequence_parallel=True), 2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 must divide"):
        check_parallel_sizes(MegatronPolicyConfig(tensor_model_parallel_size=2), 3)
    assert check_parallel_sizes(MegatronPolicyConfig(tensor_model_parallel_size=2), 4) == (2, 2)


def test_world_size_above_one_needs_the_runtimes_process_group(tmp_path):
    from grpo_sdk.backends.megatron.policy import init_parallel_state

    # Without a group (or with a group of another size, left by another test) the policy refuses to
    # make its own: the ranks would not find each other.
    context = _context(str(tmp_path), 1, 2)
    with pytest.raises(RuntimeError, match="megatron policy.*(not initialised|context says rank 1 of 2)"):
        init_parallel_state(None, context)
