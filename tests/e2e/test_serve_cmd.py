"""`grpoctl serve`: the rollout endpoint stand-alone over a built-in model, a model directory or a
run's checkpoint, started as a user starts it (a subprocess), stopped by a signal; and its errors."""

from __future__ import annotations

import math
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import grpoctl_env, run_grpoctl
from helpers.serve import KEY, Served, get, post


def test_serves_the_builtin_model_until_sigterm():
    with Served("builtin:tiny-gpt2", "--port", "0", "--max-new-tokens", "4", GRPO_SDK_API_KEY=KEY) as served:
        url = served.url()
        assert "curl" in served.stdout[-1] and url.startswith("http://127.0.0.1:")
        assert "$GRPO_SDK_API_KEY" in served.stdout[-1] and KEY not in served.stdout[-1]
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(f"{url}/completions", {"prompt": "1>"}, key=None)
        assert refused.value.code == 401
        answer = post(f"{url}/chat/completions", {"model": "tiny-gpt2", "max_tokens": 3,
                                                   "messages": [{"role": "user", "content": "12345>"}]})
        message = answer["choices"][0]["message"]
        assert 1 <= len(message["generation_token_ids"]) <= 3
        assert all(isinstance(t, int) for t in message["generation_token_ids"])
        assert len(message["generation_log_probs"]) == len(message["generation_token_ids"])
        assert answer["prompt_token_ids"] == message["prompt_token_ids"] and answer["prompt_token_ids"]
        default = post(f"{url}/completions", {"prompt": "12345>", "stop_token_ids": [2]})  # --max-new-tokens
        assert len(default["choices"][0]["generation_token_ids"]) <= 4
        longer = post(f"{url}/completions", {"prompt": "12345>", "max_tokens": 40, "stop_token_ids": [2]})
        assert len(longer["choices"][0]["generation_token_ids"]) <= 40  # a request's own; the context bounds it
        models = get(f"{url}/models")["data"]
        assert [m["id"] for m in models] == ["tiny-gpt2"] and models[0]["max_model_len"] == 64  # the recipe's
        started = time.monotonic()
        code, stderr = served.stop(signal.SIGTERM)
    assert code == 0, stderr
    assert time.monotonic() - started < 10
    assert "Traceback" not in stderr and "SIGTERM" in stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1"])
def test_beyond_loopback_without_a_key_is_a_usage_error(host):
    env = {k: v for k, v in grpoctl_env().items() if k != "GRPO_SDK_API_KEY"}
    result = run_grpoctl("serve", "builtin:tiny-gpt2", "--host", host, env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --host") and "--api-key" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_bad_models_and_a_taken_port_are_usage_errors(cli, tmp_path):
    """One line each, exit 2, before anything is loaded."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.resolved.yaml").write_text("policy:\n  model_name: builtin:tiny-gpt2\n")
    (tmp_path / "file").write_text("x")
    cases = {str(tmp_path / "missing"): "no such directory", str(tmp_path / "empty"): "neither",
             str(tmp_path / "run"): "holds no complete checkpoint", str(tmp_path / "file"): "is a file"}
    for model, expected in cases.items():
        code, out, err = cli("serve", model, "--port", "0")
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (model, err)
    code, _, err = cli("serve", "builtin:tiny-gpt2", "--step", "3")
    assert code == 2 and "run directory" in err
    code, _, err = cli("serve", "builtin:tiny-gpt2", "--tool-parser", "nonsense")
    assert code == 2 and err.startswith("error: --tool-parser")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = cli("serve", "builtin:tiny-gpt2", "--port", str(port))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1


def test_serve_help_imports_nothing_heavy():
    script = ("import sys\nfrom grpo_sdk.cli.app import main\n"
              "try:\n    rc = main(['serve', '--help'])\nexcept SystemExit as exc:\n    rc = exc.code\n"
              "print(rc, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script], env=grpoctl_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip().splitlines()[-1] == "0 []", result.stderr


COUNTING_BACKEND = '''
"""A third-party generation backend from a -p module: answers 5, 6, 7, ... and records its shutdown."""
import os
import torch
from grpo_sdk.plugins import ComponentSpec, GenerationOutput, hookimpl


class Counting:
    def __init__(self, config, context):
        self.pad = context.pad_token_id

    def generate(self, prompts, sampling):
        rows, n = prompts.input_ids.shape[0], sampling.max_new_tokens
        ids = torch.arange(5, 5 + n).repeat(rows, 1)
        return GenerationOutput(response_ids=ids, response_lengths=torch.full((rows,), n),
                                logprobs=torch.full((rows, n), -0.5), truncated=torch.ones(rows, dtype=torch.bool))

    def shutdown(self):
        open(os.environ["COUNTING_SHUTDOWN"], "w").close()


@hookimpl
def grpo_components():
    return [ComponentSpec(name="counting", kind="generation", impl="counting_backend:Counting")]
'''


def test_serves_through_a_third_party_backend(tmp_path):
    """--backend builds through the registry as a run does: a -p module's backend serves, and is shut down."""
    (tmp_path / "counting_backend.py").write_text(COUNTING_BACKEND)
    marker = tmp_path / "shut_down"
    with Served("builtin:tiny-gpt2", "-p", "counting_backend", "--backend", "counting", "--port", "0", cwd=tmp_path,
                COUNTING_SHUTDOWN=str(marker)) as served:
        url = served.url()
        assert "counting)" in served.stdout[-1]
        answer = post(f"{url}/completions", {"prompt": "1>", "max_tokens": 3})["choices"][0]
        assert (answer["generation_token_ids"], answer["generation_log_probs"]) == ([5, 6, 7], [-0.5] * 3)
        code, stderr = served.stop()
    assert code == 0, stderr
    assert marker.exists()


# --- a run's checkpoint ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """Two steps of the built-in recipe, a checkpoint at step 2, and the learning rate high enough that
    the checkpoint's weights are clearly not the initial model's."""
    cwd = tmp_path_factory.mktemp("serve_run")
    result = run_grpoctl("run", "--run-dir", "run", "grpo.max_num_steps=2", "grpo.num_prompts_per_step=4",
                         "grpo.num_generations_per_prompt=4", "checkpointing.save_period=2",
                         "policy.optimizer.lr=0.01", cwd=cwd, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "run"


def sequence_logprobs(model_dir: Path, prompt: list[int], generated: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(generated)[:, None])[:, 0].tolist()


def greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_serves_a_runs_latest_checkpoint(trained_run):
    checkpoint = trained_run / "checkpoints" / "step_2"
    assert checkpoint.is_dir()
    with Served(trained_run, "--port", "0", "--model-name", "ckpt") as served:
        url = served.url()
        assert f"checkpoint {checkpoint}" in served.stdout[-1]
        sampled = post(f"{url}/completions", {"prompt": "38637>", "max_tokens": 5, "temperature": 1.0, "seed": 3})
        choice = sampled["choices"][0]
        greedy_answer = post(f"{url}/completions", {"prompt": "38637>", "max_tokens": 5, "temperature": 0})
        assert get(f"{url}/models")["data"][0] == {"id": "ckpt", "object": "model", "owned_by": "grpo-sdk",
                                                   "max_model_len": 64}  # the run's policy.max_total_sequence_length
        code, stderr = served.stop(signal.SIGINT)
    assert code == 0, stderr
    prompt, generated = sampled["prompt_token_ids"], choice["generation_token_ids"]
    assert generated
    served_logprobs = choice["generation_log_probs"]
    assert sequence_logprobs(checkpoint / "policy", prompt, generated) == pytest.approx(served_logprobs, abs=1e-4)
    initial = sequence_logprobs(trained_run / "initial_model", prompt, generated)
    assert max(abs(a - b) for a, b in zip(initial, served_logprobs)) > 1e-3  # not the initial weights
    greedy_ids = greedy_answer["choices"][0]["generation_token_ids"]
    assert all(math.isfinite(lp) for lp in greedy_answer["choices"][0]["generation_log_probs"])  # temperature 0
    assert greedy_ids == greedy(checkpoint / "policy", prompt, 5)[:len(greedy_ids)]


def test_model_source_finds_the_checkpoint(trained_run, tmp_path):
    from grpo_sdk.cli.serve_cmd import ServeError, model_source

    policy = trained_run / "checkpoints" / "step_2" / "policy"
    for model in (trained_run, trained_run / "checkpoints" / "step_2"):
        source = model_source(str(model))
        assert Path(source.model_name) == policy and source.saved_config == trained_run / "config.resolved.yaml"
    assert model_source(str(trained_run), step=2).model_name == str(policy)
    with pytest.raises(ServeError, match="no checkpoint of step 7"):
        model_source(str(trained_run), step=7)
    direct = model_source(str(policy))  # the policy itself is a Hugging Face model directory
    assert direct.model_name == str(policy) and direct.saved_config is None and direct.default_name == "policy"
    assert model_source("builtin:tiny-gpt2").default_name == "tiny-gpt2"


def test_a_typo_between_two_options_names_both(cli):
    code, out, err = cli("serve", "builtin:tiny-gpt2", "--top-", "1")
    assert (code, out) == (2, "") and err.splitlines()[-1] == "Error: No such option: --top-. Did you mean --top-k or --top-p?"


def test_a_model_directory_serves_its_own_context_length(tiny_model_dir, registry, tmp_path):
    from grpo_sdk.cli.serve_cmd import ServeRequest, model_source, serve_config

    source = model_source(str(tiny_model_dir))
    cfg = serve_config(ServeRequest(model=str(tiny_model_dir)), source, tmp_path, registry)
    assert cfg.policy.model_name == str(tiny_model_dir) and cfg.policy.max_total_sequence_length == 64
    assert cfg.policy.generation.max_new_tokens == 32
    flags = {"policy.max_total_sequence_length": 48, "policy.generation.temperature": 0.5}
    cfg = serve_config(ServeRequest(model=str(tiny_model_dir), flags=flags, top_k_off=True,
                                    overrides=["policy.generation.top_k=5", "policy.generation.max_new_tokens=8"]),
                       source, tmp_path, registry)
    assert (cfg.policy.max_total_sequence_length, cfg.policy.generation.temperature) == (48, 0.5)
    assert (cfg.policy.generation.top_k, cfg.policy.generation.max_new_tokens) == (None, 8)  # the flag wins
