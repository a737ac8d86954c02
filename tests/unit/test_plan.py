"""The run plan (`grpoctl run --dry-run`, ``grpo_sdk.cli.plan``): what a run would do, from the config alone.

Its numbers are checked against what really happens: parameter counts against the numel of the
model transformers builds (GPT-2, Llama, Mistral, Qwen2, Qwen3, and an architecture only the
safetensors headers can count), the steps a dataset's epochs allow against the run's own prompt
sources (``DatasetPrompts``, ``MixturePrompts``), and the validation and checkpoint cadence
against a real training run.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import struct
import subprocess
import sys

import pytest

from grpo_sdk.cli.model_size import architecture_parameters, model_size, safetensors_parameters
from grpo_sdk.cli.plan import count_rows, make_plan, mixture_epoch_steps, run_plan
from grpo_sdk.config.loading import load_config


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def saved_model(tmp_path, config):
    """A randomly initialised causal LM of ``config``, written with save_pretrained: (directory, numel)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    hf_logging.disable_progress_bar()
    model.save_pretrained(tmp_path)
    return tmp_path, numel(model)


def prompts_file(path, rows: int):
    path.write_text("".join(json.dumps({"prompt": f"{i}>", "target": str(i)[::-1]}) + "\n" for i in range(rows)))
    return path


# --- the built-in recipe ------------------------------------------------------------------------------


def test_the_recipe_plan_counts_the_built_in_model_exactly(registry, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    torch.set_num_threads(1)
    cfg = load_config(None, [], registry)
    plan = make_plan(cfg, registry)
    real = numel(AutoModelForCausalLM.from_pretrained(build_tiny_gpt2(tmp_path, seed=0)))
    assert plan.model.params == real
    assert plan.rows_per_step == cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert plan.optimizer_steps_per_step == 1  # train_global_batch_size: null, one step over the whole batch
    assert plan.max_tokens_per_step == plan.rows_per_step * cfg.policy.max_total_sequence_length
    assert (plan.steps, plan.epoch_steps) == (cfg.grpo.max_num_steps, None)  # the environment makes the prompts
    # float32 weights and gradients, fp32 AdamW moments; the recipe has no KL penalty, so no reference copy,
    # and the hf generation samples with the policy's module (tests/unit/test_memory_plan.py has the other parts)
    parts = plan.memory_bytes
    assert (parts["weights"], parts["gradients"], parts["adamw_moments"]) == (4 * real, 4 * real, 8 * real)
    assert parts["generation_weights"] == 0 and "reference_model" not in parts


def test_the_recipe_plan_text_names_every_component_and_what_it_leaves_out(registry):
    text = run_plan(load_config(None, [], registry), registry)
    version = md.version("grpo-sdk")
    for label, name in [("policy backend", "hf"), ("generation backend", "hf"), ("advantage estimator", "grpo"),
                        ("environment", "reverse_digits"), ("weight-sync transport", "inprocess"),
                        ("logger", "jsonl")]:
        (line,) = [line for line in text.splitlines() if line.strip().startswith(label)]
        assert line.split()[-3:] == [name, "grpo-sdk", version], line
    assert "runtime                local" in text
    assert "128 rows (8 prompts x 16 generations)" in text
    assert "steps: 500 steps requested (grpo.max_num_steps); the environment reverse_digits makes the prompts" in text
    assert "memory (an estimate, float32):" in text
    for part in ("activations", "logits", "KV cache", "total (peak)"):
        assert any(line.strip().startswith(part) for line in text.splitlines()), part
    assert "Traceback" not in text


def test_kl_penalty_precision_and_mini_batches_change_the_plan(registry):
    cfg = load_config(None, ["loss_fn.reference_policy_kl_penalty=0.05", "policy.precision=bfloat16",
                             "policy.train_global_batch_size=32", "policy.train_micro_batch_size=8"], registry)
    plan = make_plan(cfg, registry)
    params = plan.model.params
    assert plan.optimizer_steps_per_step == 128 // 32
    assert plan.memory_bytes["weights"] == plan.memory_bytes["reference_model"] == 2 * params
    assert plan.memory_bytes["adamw_moments"] == 8 * params
    phases = ("activations", "logits", "kv_cache", "total")
    lasting = sum(v for k, v in plan.memory_bytes.items() if k not in phases)
    assert plan.memory_bytes["total"] == lasting + max(plan.memory_bytes["activations"] + plan.memory_bytes["logits"],
                                                       plan.memory_bytes["kv_cache"])
    text = plan.render()
    assert "4 optimizer steps of 32 rows (policy.train_global_batch_size), each in 4 micro-batches of 8 rows" in text
    assert "loss_fn.reference_policy_kl_penalty=0.05" in text


def test_the_plan_imports_no_torch():
    code = ("import sys; from grpo_sdk.plugins.registry import Registry; from grpo_sdk.config.loading import "
            "load_config; from grpo_sdk.cli.plan import run_plan; r = Registry.discover(); "
            "print(run_plan(load_config(None, [], r), r)); assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "parameters" in proc.stdout


# --- parameter counts ------------------------------------------------------------------------------


def test_a_local_gpt2_directory_is_counted_from_its_config(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    size = model_size(str(tiny_model_dir))
    assert size.params == numel(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert size.how == "config.json (gpt2)"
    # the headers agree: tied embeddings are saved once
    assert safetensors_parameters(tiny_model_dir) == (size.params, 1)


def _llama_family_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    shape = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    return {
        "llama": LlamaConfig(**shape, num_key_value_heads=2),
        "llama-biases-tied-head_dim": LlamaConfig(**shape, attention_bias=True, mlp_bias=True, head_dim=16,
                                                  tie_word_embeddings=True),
        "mistral": MistralConfig(**shape, num_key_value_heads=2),
        "qwen2-tied": Qwen2Config(**shape, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**shape, num_key_value_heads=1, head_dim=8),
    }


@pytest.mark.parametrize("name", ["llama", "llama-biases-tied-head_dim", "mistral", "qwen2-tied", "qwen3"])
def test_a_llama_family_directory_is_counted_from_its_config(tmp_path, name):
    config = _llama_family_configs()[name]
    directory, real = saved_model(tmp_path, config)
    size = model_size(str(directory))
    assert (size.params, size.how) == (real, f"config.json ({config.model_type})")
    assert size.vocab_size == config.vocab_size


def test_an_unknown_architecture_is_counted_from_the_safetensors_headers(tmp_path):
    from transformers import Phi3Config

    assert architecture_parameters({"model_type": "phi3"}) is None
    directory, real = saved_model(tmp_path, Phi3Config(vocab_size=61, hidden_size=32, intermediate_size=48,
                                                       num_hidden_layers=2, num_attention_heads=4, pad_token_id=0))
    size = model_size(str(directory))
    assert (size.params, size.how) == (real, "the headers of 1 .safetensors file")


def test_sharded_safetensors_are_counted_through_their_index(tmp_path):
    from transformers import AutoModelForCausalLM, Phi3Config

    model = AutoModelForCausalLM.from_config(Phi3Config(vocab_size=61, hidden_size=32, intermediate_size=48,
                                                        num_hidden_layers=2, num_attention_heads=4, pad_token_id=0))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    params, files = safetensors_parameters(tmp_path)
    assert (params, files > 1) == (numel(model), True)
    assert model_size(str(tmp_path)).params == numel(model)


def test_a_hub_model_in_the_local_cache_is_counted_from_its_cached_config(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    snapshot = tmp_path / "models--acme--tiny-qwen" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--acme--tiny-qwen" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-qwen" / "refs" / "main").write_text("abc123")
    config.save_pretrained(snapshot)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    size = model_size("acme/tiny-qwen")
    assert size.params == numel(AutoModelForCausalLM.from_config(config))
    assert size.how == "config.json in the hub cache (qwen2)"
    assert model_size("acme/not-cached").params is None


def test_an_uncountable_model_gives_no_estimate_and_says_why(registry, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    cfg = load_config(None, ["policy.model_name=acme/not-downloaded"], registry)
    plan = make_plan(cfg, registry)
    assert (plan.model.params, plan.memory_bytes) == (None, {})
    text = plan.render()
    assert "model: acme/not-downloaded: not counted: not a local model directory" in text
    assert "nothing is downloaded for a plan" in text
    assert "not estimated: the parameter count is unknown" in text


@pytest.mark.parametrize("content, problem", [
    (b"\x01", "too short"),
    (struct.pack("<Q", 2**40), "not a .safetensors file"),
    (struct.pack("<Q", 5) + b"nope!", "the header is not JSON"),
    (struct.pack("<Q", 2) + b"[]", "the header is not a JSON object"),
    (struct.pack("<Q", 23) + b'{"w": {"dtype": "F32"}}', "KeyError"),
])
def test_a_damaged_safetensors_file_is_reported_not_raised(tmp_path, content, problem):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "acme-lm"}))
    (tmp_path / "model.safetensors").write_bytes(content)
    size = model_size(str(tmp_path))
    assert size.params is None
    assert size.how.startswith("not counted: ") and problem in size.how


def test_a_directory_without_weights_or_a_known_architecture_says_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "acme-lm"}))
    size = model_size(str(tmp_path))
    assert size.params is None
    assert "architecture 'acme-lm' is not one the plan knows" in size.how and ".safetensors" in size.how


# --- steps and epochs ------------------------------------------------------------------------------


def steps_until_epochs(source, per_step: int, epochs: int) -> int:
    """Steps the run's own prompt source gives before its epoch counter reaches ``epochs`` (trainer.finished)."""
    steps = 0
    while source.epoch < epochs:
        source.next_prompts(per_step)
        steps += 1
    return steps


def _prompts(n: int):
    from grpo_sdk.data.prompts import Prompt

    return [Prompt(text=str(i), metadata={}, source=f"row {i}") for i in range(n)]


@pytest.mark.parametrize("rows, per_step, epochs", [(20, 4, 1), (21, 4, 1), (21, 4, 3), (200, 8, 1), (7, 7, 2)])
def test_the_epochs_line_gives_the_steps_the_dataset_allows(registry, tmp_path, rows, per_step, epochs):
    from grpo_sdk.data.prompt_sources import DatasetPrompts

    data = prompts_file(tmp_path / "train.jsonl", rows)
    cfg = load_config(None, [f"data.train_path={data}", f"grpo.num_prompts_per_step={per_step}",
                             "grpo.num_generations_per_prompt=2", f"grpo.max_num_epochs={epochs}",
                             "grpo.max_num_steps=300"], registry)
    plan = make_plan(cfg, registry)
    real = steps_until_epochs(DatasetPrompts(_prompts(rows), shuffle=True, seed=0), per_step, epochs)
    assert (plan.epoch_steps, plan.steps) == (real, real)
    needed = math.ceil(300 * per_step / rows)
    epochs_text = f"{epochs} epoch{'s' * (epochs > 1)} of {rows} prompts"
    assert (f"steps: 300 steps requested, {real} possible with {epochs_text} (grpo.max_num_epochs={epochs}); "
            f"grpo.max_num_epochs={needed} trains all 300") in plan.render()
    # the override the line names does train them all
    more = load_config(None, [f"data.train_path={data}", f"grpo.num_prompts_per_step={per_step}",
                              "grpo.num_generations_per_prompt=2", f"grpo.max_num_epochs={needed}",
                              "grpo.max_num_steps=300"], registry)
    assert make_plan(more, registry).steps == 300


def test_epochs_that_allow_every_step_say_so(registry, tmp_path):
    data = prompts_file(tmp_path / "train.jsonl", 100)
    cfg = load_config(None, [f"data.train_path={data}", "grpo.num_prompts_per_step=4", "grpo.max_num_steps=10"],
                      registry)
    plan = make_plan(cfg, registry)
    assert (plan.steps, plan.epoch_steps) == (10, 25)
    assert "steps: 10 steps requested (grpo.max_num_steps); 1 epoch of 100 prompts allows them" in plan.render()


@pytest.mark.parametrize("sizes, weights, per_step, epochs", [
    ([40, 40], [3.0, 1.0], 4, 1), ([10, 30, 7], [1.0, 1.0, 2.0], 6, 2), ([5, 9], [0.3, 0.7], 5, 1),
])
def test_a_mixture_s_epochs_are_counted_as_the_run_draws(sizes, weights, per_step, epochs):
    from grpo_sdk.data.prompt_sources import DatasetPrompts, MixturePrompts

    source = MixturePrompts([DatasetPrompts(_prompts(n), shuffle=False, seed=0, salt=f"t{i}")
                             for i, n in enumerate(sizes)], weights)
    real = steps_until_epochs(source, per_step, epochs)
    assert mixture_epoch_steps(sizes, weights, per_step, epochs, max_steps=10_000) == real
    assert mixture_epoch_steps(sizes, weights, per_step, epochs, max_steps=real - 1) is None


def test_rows_are_counted_in_every_local_format(tmp_path):
    import datasets

    rows = [{"prompt": f"{i}>", "target": str(i)} for i in range(13)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n\n")  # blank lines skipped
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:2]),
                          "train": datasets.Dataset.from_list(rows[:5])}).save_to_disk(str(tmp_path / "splits"))
    assert count_rows(str(tmp_path / "a.jsonl")) == (13, "")
    assert count_rows(str(tmp_path / "a.parquet")) == (13, "")
    assert count_rows(str(tmp_path / "saved")) == (13, "")
    assert count_rows(str(tmp_path / "splits")) == (5, "")  # the train split, as the run reads it


@pytest.mark.parametrize("path, why", [
    ("hf:openai/gsm8k", "a hub dataset, counted once it is loaded"),
    ("{tmp}/missing.jsonl", "not counted (FileNotFoundError"),
    ("{tmp}/data.csv", "is not a JSONL, Parquet or save_to_disk dataset"),
])
def test_a_dataset_that_cannot_be_counted_leaves_the_steps_as_requested(registry, tmp_path, path, why):
    (tmp_path / "data.csv").write_text("prompt\n1>\n")
    path = path.format(tmp=tmp_path)
    assert count_rows(path)[0] is None and why in count_rows(path)[1]
    cfg = load_config(None, [f"data.train_path={path}", "grpo.max_num_steps=30"], registry)
    plan = make_plan(cfg, registry)
    assert (plan.steps, plan.epoch_steps) == (30, None)
    assert f"30 steps requested (grpo.max_num_steps), bounded by grpo.max_num_epochs=1; {path}: " in plan.render()


def test_a_dataset_smaller_than_a_step_is_called_out(registry, tmp_path):
    data = prompts_file(tmp_path / "train.jsonl", 3)
    cfg = load_config(None, [f"data.train_path={data}", "grpo.num_prompts_per_step=4"], registry)
    assert ("the data holds 3 prompts, fewer than the grpo.num_prompts_per_step=4 every step draws: the run stops "
            "at start") in run_plan(cfg, registry)


# --- cadence, against a real run --------------------------------------------------------------------


def test_the_planned_steps_validations_and_checkpoints_are_what_the_run_does(registry, tmp_path, tiny_model_dir):
    from grpo_sdk.trainer.trainer import GRPOTrainer

    data = prompts_file(tmp_path / "train.jsonl", 9)
    cfg = load_config(None, [f"policy.model_name={tiny_model_dir}", f"data.train_path={data}",
                             "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                             "grpo.max_num_steps=300", "grpo.val_period=2", "grpo.val_at_end=true",
                             "grpo.max_val_samples=2", "checkpointing.save_period=2", "checkpointing.keep_top_k=null",
                             "policy.train_micro_batch_size=4", "policy.logprob_batch_size=4"], registry)
    plan = make_plan(cfg, registry)
    run_dir = tmp_path / "run"
    trainer = GRPOTrainer(cfg, run_dir=run_dir, registry=registry)
    try:
        trainer.setup()
        summary = trainer.train()
    finally:
        trainer.shutdown()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = {r["step"] for r in records if any(k.startswith("val/") for k in r)}
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert plan.steps == summary.steps == 5  # ceil(9 prompts / 2 per step)
    text = plan.render()
    assert f"{len(validations)} validations of 2 prompts" in text and len(validations) == 3  # steps 2, 4 and the end
    assert f"{len(checkpoints)} saves into <run dir>/checkpoints" in text and len(checkpoints) == 3
