"""The hf policy as 2 data-parallel FSDP2 ranks (gloo, CPU, no Ray) gives one process's results.

One module fixture runs the same scenario once in this process (world_size 1) and once in a
2-rank group started with ``torch.multiprocessing`` (world_size 2), on a tiny GPT-2 (tied
embeddings) and a tiny Llama (untied, RoPE, gradient checkpointing): logprobs, reference
logprobs, six optimizer steps in three ``train`` calls (ragged token masks, a masked sample, a KL
term, two optimizer steps per call, the in-loss logprob-error filter), ``named_weights``,
offload/onload, and checkpoints that each world loads from the other.
"""

from __future__ import annotations

import datetime
import json
import math
import socket
from pathlib import Path

import attrs
import pytest
import torch

from grpo_sdk.algorithms.loss import ClippedPGLoss
from grpo_sdk.core.errors import NonFiniteError
from grpo_sdk.core.records import TrainBatch

WORLD = 2
ROWS = 8  # two global batches of 4: each rank trains on 2 rows of each
MODELS = {"gpt2": dict(micro=2, gradient_checkpointing=False),  # one micro-batch per rank per step
          "llama": dict(micro=1, gradient_checkpointing=True)}  # two per rank: FSDP accumulates


def build_tiny_llama(out_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_sdk.recipes.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_policy(model_dir: Path, name: str, rank: int = 0, world: int = 1):
    from grpo_sdk.backends.hf.config import HFPolicyConfig
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.plugins.registry import Registry

    cfg = load_config(None, [f"policy.model_name={model_dir}", f"policy.train_micro_batch_size={MODELS[name]['micro']}",
                             "policy.train_global_batch_size=4", "policy.logprob_batch_size=1",
                             "policy.optimizer.lr=0.001", "grpo.num_prompts_per_step=2",
                             "grpo.num_generations_per_prompt=4", "loss_fn.reference_policy_kl_penalty=0.05"],
                      Registry.discover())
    context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                         device="cpu", seed=0, needs_reference=True, rank=rank, world_size=world)
    return HFPolicy(HFPolicyConfig(gradient_checkpointing=MODELS[name]["gradient_checkpointing"]), context), cfg


def random_batch(rows: int = ROWS, width: int = 9, vocab: int = 25) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    token_mask = torch.zeros(rows, width)
    for i in range(rows):
        token_mask[i, 4:4 + int(torch.randint(1, width - 4, (1,), generator=g))] = 1  # ragged responses
    return TrainBatch(
        input_ids=torch.randint(4, vocab, (rows, width), generator=g), attention_mask=torch.ones(rows, width).long(),
        token_mask=token_mask, sample_mask=torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 0][:rows]),
        generation_logprobs=-torch.rand(rows, width, generator=g), group_ids=torch.arange(rows) // 4,
        rewards=torch.zeros(rows), advantages=torch.randn(rows, 1, generator=g).expand(rows, width).contiguous())


def scenario(policy, cfg, ckpt: Path) -> dict:
    """Everything compared between the worlds; ends with a checkpoint of the trained policy."""
    data = random_batch()
    out = {"logprobs": policy.logprobs(data), "reference": policy.reference_logprobs(data)}
    data.prev_logprobs = out["logprobs"]
    data.reference_logprobs = out["reference"] - 0.1
    loss_fn = ClippedPGLoss(cfg.loss_fn)
    metrics = [policy.train(data, loss_fn), policy.train(data, loss_fn)]
    # The in-loss filter: rows 0, 4 and 5 sample as the policy does now; the others are e times
    # off (seq_logprob_error 2.7 > 2), and three of those are not masked samples.
    trusted = policy.logprobs(data)
    filtered = attrs.evolve(data, generation_logprobs=torch.where(
        torch.tensor([1, 0, 0, 0, 1, 1, 0, 0]).bool()[:, None], trusted, trusted - 1))
    filter_cfg = attrs.evolve(cfg.loss_fn, seq_logprob_error_in_loss=True, force_on_policy_ratio=True)
    filter_fn = ClippedPGLoss(filter_cfg, seq_logprob_error_threshold=2.0)
    metrics.append(policy.train(filtered, filter_fn))
    out["metrics"] = metrics
    out["weights"] = {name: tensor.detach().clone() for name, tensor in policy.named_weights()}
    policy.offload()
    policy.onload()
    out["trained_logprobs"] = policy.logprobs(data)
    policy.save_checkpoint(str(ckpt))
    out["continued"] = continued(policy, cfg)
    return out


def continued(policy, cfg) -> dict:
    """One more train call (two optimizer steps) and the weights after it: this needs the exact
    optimizer state (Adam moments and step) and LR schedule, so it checks a loaded checkpoint."""
    data = random_batch()
    data.prev_logprobs = policy.logprobs(data)
    data.reference_logprobs = policy.reference_logprobs(data)
    metrics = policy.train(data, ClippedPGLoss(cfg.loss_fn))
    return {"metrics": metrics, "weights": {n: t.detach().clone() for n, t in policy.named_weights()}}


class NaNOnRank:
    """A loss that is NaN on one rank only."""

    def __init__(self, loss_fn, rank: int):
        self.loss_fn, self.rank = loss_fn, rank

    def __call__(self, logprobs, batch, **kwargs):
        import torch.distributed as dist

        loss, metrics = self.loss_fn(logprobs, batch, **kwargs)
        return (loss * math.nan if dist.get_rank() == self.rank else loss), metrics


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(rank: int, port: int, root: str) -> None:
    """One rank of the group: the scenario on each model, loading the single-process checkpoint,
    and the divisibility errors; results go to ``root/<model>-rank<r>.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A timeout turns a collective one rank never reaches into an error instead of a hang.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        root_dir = Path(root)
        for name in MODELS:
            policy, cfg = make_policy(root_dir / name, name, rank, WORLD)
            out = scenario(policy, cfg, root_dir / f"{name}-ckpt-dp")
            fresh, _ = make_policy(root_dir / name, name, rank, WORLD)
            fresh.load_checkpoint(str(root_dir / f"{name}-ckpt-single"))
            out["loaded_single_continued"] = continued(fresh, cfg)
            errors = []
            for call in (lambda: fresh.train(random_batch(7), ClippedPGLoss(cfg.loss_fn)),
                         lambda: fresh.logprobs(random_batch(7))):
                try:
                    call()
                except ValueError as exc:
                    errors.append(str(exc))
            out["errors"] = errors
            before = dict(fresh.named_weights())
            data = random_batch()
            data.reference_logprobs = torch.zeros_like(data.generation_logprobs)
            try:  # a NaN loss on rank 1 only: both ranks stop, neither steps
                fresh.train(data, NaNOnRank(ClippedPGLoss(cfg.loss_fn), rank=1))
            except NonFiniteError as exc:
                out["nan_error"] = str(exc)
            out["nan_untouched"] = all(torch.equal(before[n], t) for n, t in fresh.named_weights())
            out["after_errors"] = fresh.logprobs(random_batch())  # the group is still in step
            torch.save(out, root_dir / f"{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    root = tmp_path_factory.mktemp("fsdp")
    build_tiny_gpt2(root / "gpt2", seed=0)
    build_tiny_llama(root / "llama")
    single = {}
    for name in MODELS:
        policy, cfg = make_policy(root / name, name)
        single[name] = scenario(policy, cfg, root / f"{name}-ckpt-single")
    mp.spawn(rank_main, args=(free_port(), str(root)), nprocs=WORLD, join=True)
    dp = {name: [torch.load(root / f"{name}-rank{r}.pt", weights_only=True) for r in range(WORLD)]
          for name in MODELS}
    for name in MODELS:  # the checkpoint the group wrote, loaded by one process
        policy, cfg = make_policy(root / name, name)
        policy.load_checkpoint(str(root / f"{name}-ckpt-dp"))
        single[name]["loaded_dp_continued"] = continued(policy, cfg)
    return root, single, dp


def assert_metrics_equal(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        if math.isinf(value):
            assert actual[key] == value, key
        else:
            assert actual[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def assert_weights_equal(actual: dict, expected: dict) -> None:
    # The all-reduce sums gradients in another order than one process does; Adam divides by sqrt(v),
    # so for a near-zero gradient that rounding difference becomes part of a step of size ~lr (1e-3).
    # Measured after five optimizer steps: up to 2.2e-6 on an AMD EPYC host (below 1e-6 on the
    # machine this test was written on). A rank left out changes the gradient's direction and moves
    # weights by up to lr; a wrong gradient scale shows in the metrics compared above (rel 1e-5).
    assert list(actual) == list(expected)  # same names, same order
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-6, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_train_as_one_process(runs, name):
    _, single, dp = runs
    expected = single[name]
    for rank_out in dp[name]:  # every rank returns the whole batch's results
        torch.testing.assert_close(rank_out["logprobs"], expected["logprobs"], rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_out["reference"], expected["reference"], rtol=0, atol=1e-6)
        assert len(rank_out["metrics"]) == 3
        for actual, wanted in zip(rank_out["metrics"], expected["metrics"]):
            assert_metrics_equal(actual, wanted)
        assert_weights_equal(rank_out["weights"], expected["weights"])
        torch.testing.assert_close(rank_out["trained_logprobs"], expected["trained_logprobs"], rtol=0, atol=1e-5)
        assert_metrics_equal(rank_out["continued"]["metrics"], expected["continued"]["metrics"])
        assert_weights_equal(rank_out["continued"]["weights"], expected["continued"]["weights"])
    # The scenario is not vacuous: the weights moved, the filter dropped rows, the KL term counts.
    first, filtered = expected["metrics"][0], expected["metrics"][2]
    assert first["grad_norm"] > 0 and first["kl_penalty"] > 0 and first["num_valid_samples"] == 3
    # Per optimizer step (rows 0-3, then 4-7): 2 then 1 rows dropped, 1 then 2 kept; the mean of the two.
    assert filtered["num_masked_seqs_by_logprob_error"] == 1.5 and filtered["seq_logprob_error_valid_seqs"] == 1.5
    assert not torch.allclose(expected["trained_logprobs"], expected["logprobs"])


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoints_load_across_world_sizes(runs, name):
    root, single, dp = runs
    # The group writes what one process writes: same files, names and optimizer layout.
    single_dir, dp_dir = root / f"{name}-ckpt-single", root / f"{name}-ckpt-dp"
    assert sorted(p.name for p in dp_dir.iterdir()) == sorted(p.name for p in single_dir.iterdir())
    from safetensors.torch import load_file

    for file in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(dp_dir / file)), load_file(str(single_dir / file))
        assert sorted(a) == sorted(b)
        if file == "model.safetensors":  # Adam's amplified rounding, as in assert_weights_equal
            assert_weights_equal(dict(sorted(a.items())), dict(sorted(b.items())))
            continue
        for key in b:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    meta_dp, meta_single = (json.loads((d / "optimizer.json").read_text()) for d in (dp_dir, single_dir))
    assert meta_dp == meta_single
    # Each world resumes from the other's checkpoint exactly where the writer would have gone on.
    for rank_out in dp[name]:
        assert_metrics_equal(rank_out["loaded_single_continued"]["metrics"], single[name]["continued"]["metrics"])
        assert_weights_equal(rank_out["loaded_single_continued"]["weights"], single[name]["continued"]["weights"])
    assert_metrics_equal(single[name]["loaded_dp_continued"]["metrics"], dp[name][0]["continued"]["metrics"])
    assert_weights_equal(single[name]["loaded_dp_continued"]["weights"], dp[name][0]["continued"]["weights"])


def test_rows_that_do_not_split_over_the_ranks_are_a_clear_error(runs):
    _, single, dp = runs
    for rank_out in dp["gpt2"]:
        train_error, logprobs_error = rank_out["errors"]
        assert "7 rows do not split evenly over 2 data-parallel policy ranks" in train_error
        assert "policy.train" in train_error and "policy logprobs" in logprobs_error
        assert "multiples of 2" in train_error
        torch.testing.assert_close(rank_out["after_errors"], dp["gpt2"][0]["after_errors"], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_nan_loss_on_one_rank_stops_every_rank_before_the_step(runs, name):
    _, _, dp = runs
    rank0, rank1 = dp[name]
    # The policy loaded a checkpoint of 6 optimizer steps and went on for 2.
    assert rank0["nan_error"] == "loss is not finite on another data-parallel rank in optimizer step 9"
    first_row = 2  # rank 1's share of the first global batch (rows 0..3) is rows 2..3
    last_row = first_row + MODELS[name]["micro"] - 1
    assert rank1["nan_error"] == f"loss is nan in optimizer step 9, rows {first_row}..{last_row}"
    assert rank0["nan_untouched"] and rank1["nan_untouched"]


def test_a_data_parallel_policy_needs_the_process_group(tmp_path):
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    build_tiny_gpt2(tmp_path / "gpt2", seed=0)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        make_policy(tmp_path / "gpt2", "gpt2", rank=0, world=2)
