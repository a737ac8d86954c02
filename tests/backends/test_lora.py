"""LoRA through peft in the hf policy (``policy.lora``): adapters-only training, the frozen base as
the reference (no copy), merged weight sync under the base names, adapter-only checkpoints, FSDP2
data parallel equal to one process, export, and the config errors."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from grpo_sdk.algorithms.loss import ClippedPGLoss  # noqa: E402
from grpo_sdk.core.errors import ConfigError, PluginError  # noqa: E402
from helpers import grpoctl_env, run_grpoctl  # noqa: E402
from test_fsdp import (assert_metrics_equal, assert_weights_equal, build_tiny_llama, continued,  # noqa: E402
                       free_port, random_batch, scenario)

WORLD = 2
MODELS = {"gpt2": dict(micro=2, gradient_checkpointing=False),
          "llama": dict(micro=1, gradient_checkpointing=True)}  # checkpointing with a frozen base


def make_policy(model_dir: Path, name: str = "gpt2", rank: int = 0, world: int = 1, lora: bool = True,
                overrides: tuple[str, ...] = ()):
    from grpo_sdk.backends.hf.config import HFPolicyConfig
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.plugins.registry import Registry

    cfg = load_config(None, [f"policy.model_name={model_dir}", f"policy.train_micro_batch_size={MODELS[name]['micro']}",
                             "policy.train_global_batch_size=4", "policy.logprob_batch_size=1",
                             "policy.optimizer.lr=0.001", "grpo.num_prompts_per_step=2",
                             "grpo.num_generations_per_prompt=4", "loss_fn.reference_policy_kl_penalty=0.05",
                             f"policy.lora.enabled={str(lora).lower()}", *overrides], Registry.discover())
    context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                         device="cpu", seed=0, needs_reference=True, rank=rank, world_size=world)
    return HFPolicy(HFPolicyConfig(gradient_checkpointing=MODELS[name]["gradient_checkpointing"]), context), cfg


def base_logprobs(model_dir: Path, data) -> torch.Tensor:
    """The logprobs of the untouched model files, as a fresh process would compute them."""
    from grpo_sdk.backends.hf.forward import sequence_logprobs
    from grpo_sdk.backends.hf.loading import load_model

    model = load_model(str(model_dir), dtype="float32", device="cpu")
    with torch.no_grad():
        return sequence_logprobs(model, data.input_ids, data.attention_mask, temperature=1.0, top_k=None, top_p=1.0,
                                 token_mask=data.token_mask)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    root = tmp_path_factory.mktemp("lora") / "gpt2"
    build_tiny_gpt2(root, seed=0)
    return root


def held_storage(policy) -> set[int]:
    """Data pointers of the parameters of every module the policy object holds."""
    modules = [value for value in vars(policy).values() if isinstance(value, torch.nn.Module)]
    return {p.data_ptr() for module in modules for p in module.parameters()}


def trained(policy, cfg, steps: int = 2):
    data = random_batch()
    data.prev_logprobs = policy.logprobs(data)
    data.reference_logprobs = policy.reference_logprobs(data)
    for _ in range(steps):
        policy.train(data, ClippedPGLoss(cfg.loss_fn))
    return data


def test_only_the_adapters_train_and_the_reference_is_the_frozen_base_without_a_copy(gpt2):
    policy, cfg = make_policy(gpt2)
    names = [name for name, _ in policy.model.named_parameters()]
    adapters = [name for name in names if ".lora_A." in name or ".lora_B." in name]
    # Every linear layer but the (tied) LM head: GPT-2's c_attn, c_proj, c_fc, mlp c_proj, in 2 blocks.
    assert len(adapters) == 2 * 4 * 2 and not any("lm_head" in name for name in adapters)
    trainable = {id(p) for p in policy.params}
    assert trainable == {id(p) for n, p in policy.model.named_parameters() if n in adapters}
    assert {id(p) for group in policy.optimizer.param_groups for p in group["params"]} == trainable
    # No second model: every module the policy holds (model, peft wrapper, reference) shares the
    # model's parameter storage; a full-parameter policy, the control, holds a reference copy.
    assert policy.reference is None and held_storage(policy) == {p.data_ptr() for p in policy.model.parameters()}
    full, _ = make_policy(gpt2, lora=False)
    assert len(held_storage(full)) == 2 * len({p.data_ptr() for p in full.model.parameters()})
    base_before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if n not in adapters}

    data = trained(policy, cfg)
    after = policy.logprobs(data)
    assert not torch.allclose(after, data.prev_logprobs, atol=1e-3)  # the adapters moved the policy
    for name, value in policy.model.named_parameters():
        if name in base_before:
            assert torch.equal(value, base_before[name]), f"frozen base weight {name} changed"
    response = data.token_mask.bool()  # the policy computes logprobs at response positions only
    torch.testing.assert_close(policy.reference_logprobs(data)[response], base_logprobs(gpt2, data)[response],
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(policy.logprobs(data), after, rtol=0, atol=0)  # the adapters are back on


def test_merged_weights_are_the_base_names_and_give_the_policys_logprobs(gpt2):
    from transformers import AutoModelForCausalLM

    from grpo_sdk.backends.hf.forward import sequence_logprobs

    policy, cfg = make_policy(gpt2)
    data = trained(policy, cfg)
    training_state = {n: t.clone() for n, t in policy.model.state_dict().items()}
    merged = dict(policy.named_weights())
    # Merging did not touch the training weights (no in-place merge).
    assert all(torch.equal(t, training_state[n]) for n, t in policy.model.state_dict().items())
    fresh = AutoModelForCausalLM.from_pretrained(gpt2).eval()
    assert list(merged) == list(fresh.state_dict()) or set(merged) == set(fresh.state_dict())
    fresh.load_state_dict(merged)
    with torch.no_grad():
        got = sequence_logprobs(fresh, data.input_ids, data.attention_mask, temperature=1.0, top_k=None, top_p=1.0,
                                 token_mask=data.token_mask)
    torch.testing.assert_close(got, policy.logprobs(data), rtol=0, atol=1e-5)
    c_attn = merged["transformer.h.0.attn.c_attn.weight"]
    assert not torch.allclose(c_attn, fresh_base_weight(gpt2, "transformer.h.0.attn.c_attn.weight"))


def test_adapter_sync_sends_the_adapters_only_under_peft_file_names(gpt2, tmp_path):
    """policy.lora.sync=adapter: named_weights is A and B only, named as in peft's adapter file (what
    the vLLM backend writes into the adapter directory it loads), equal to a checkpoint's tensors."""
    from safetensors.torch import load_file

    policy, cfg = make_policy(gpt2)  # the config check allows sync=adapter with vllm generation only
    policy.lora_sync = "adapter"
    trained(policy, cfg)
    sent = {name: tensor.clone() for name, tensor in policy.named_weights()}
    policy.save_checkpoint(str(tmp_path / "ckpt"))
    saved = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    assert set(sent) == set(saved) and all(torch.equal(sent[n], saved[n]) for n in saved)
    assert all(n.startswith("base_model.model.") and (".lora_A.weight" in n or ".lora_B.weight" in n) for n in sent)
    assert any(".lora_B." in n and sent[n].abs().sum() > 0 for n in sent)  # trained: B left zero


def test_adapter_sync_is_allowed_only_with_a_backend_that_loads_adapters():
    import attrs

    from grpo_sdk.backends.vllm.config import VLLMConfig, check_options
    from grpo_sdk.config.checks.policy import check_lora
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins.registry import Registry

    registry = Registry.discover()
    cfg = load_config(None, ["policy.lora.enabled=true"], registry)
    cfg = attrs.evolve(cfg, policy=attrs.evolve(cfg.policy, lora=attrs.evolve(cfg.policy.lora, sync="adapter")))
    assert [key for key, _ in check_lora(cfg, registry)] == ["policy.lora.sync"]  # hf generation
    vllm = attrs.evolve(cfg, policy=attrs.evolve(cfg.policy, generation=attrs.evolve(cfg.policy.generation,
                                                                                      backend="vllm")))
    assert check_lora(vllm, registry) == []  # vllm declares lora_adapters
    assert check_options(vllm, VLLMConfig(), registry) == []
    problems = dict(check_options(vllm, VLLMConfig(async_engine=True), registry))
    assert "in-process engine only" in problems["policy.lora.sync"]
    big = attrs.evolve(vllm, policy=attrs.evolve(vllm.policy, lora=attrs.evolve(vllm.policy.lora, rank=1024)))
    assert "largest LoRA rank vLLM loads" in dict(check_options(big, VLLMConfig(), registry))["policy.lora.rank"]
    merged = attrs.evolve(vllm, policy=attrs.evolve(vllm.policy, lora=attrs.evolve(vllm.policy.lora, sync="merged")))
    assert check_options(merged, VLLMConfig(async_engine=True), registry) == []


def test_vllm_adapter_slot_refuses_weights_that_are_not_adapters(tmp_path):
    """Merged weights reaching a vLLM engine set up for adapters (a policy that ignored sync=adapter)
    are a clear error, not a silently empty adapter; nothing is handed to the engine."""
    from types import SimpleNamespace

    from grpo_sdk.backends.vllm.lora import AdapterSlot
    from grpo_sdk.plugins import PluginError

    engine = SimpleNamespace(add_lora=lambda request: pytest.fail("nothing may be loaded"))
    slot = AdapterSlot(engine, SimpleNamespace(policy=SimpleNamespace(lora=SimpleNamespace(rank=8, alpha=32.0))))
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    for weights in ([("model.layers.0.self_attn.q_proj.weight", torch.zeros(2, 2))],
                    [(a, torch.zeros(2, 2)), ("lm_head.weight", torch.zeros(2, 2))]):
        with pytest.raises(PluginError, match="not LoRA adapter tensors"):
            slot.load(weights, version=1)
    slot.close()
    assert not slot.root.exists()


def test_vllm_max_lora_rank_is_the_smallest_rank_vllm_accepts():
    from grpo_sdk.backends.vllm.lora import max_lora_rank

    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]


def test_bfloat16_base_with_float32_adapters(gpt2):
    policy, cfg = make_policy(gpt2, overrides=("policy.precision=bfloat16",))
    assert {p.dtype for p in policy.params} == {torch.float32}  # the updates are not rounded to bf16
    assert {p.dtype for n, p in policy.model.named_parameters() if ".lora_" not in n} == {torch.bfloat16}
    data = trained(policy, cfg)
    merged = dict(policy.named_weights())
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert not torch.allclose(policy.logprobs(data), policy.reference_logprobs(data), atol=1e-3)


def fresh_base_weight(model_dir: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))[name]


def test_checkpoints_hold_the_adapters_only_and_resume_exactly(gpt2, tmp_path):
    policy, cfg = make_policy(gpt2)
    trained(policy, cfg)
    policy.save_checkpoint(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "optimizer.json", "optimizer.safetensors"]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    assert len(saved) == 16 and all(k.startswith("base_model.model.") and ".lora_" in k for k in saved)
    expected = continued(policy, cfg)
    fresh, _ = make_policy(gpt2)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    got = continued(fresh, cfg)
    assert_metrics_equal(got["metrics"], expected["metrics"])
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=0, msg=name)
    # peft itself reads the directory: the checkpoint is a usable adapter.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gpt2), str(tmp_path / "ckpt"))
    assert sum(p.numel() for n, p in loaded.named_parameters() if "lora_" in n) == \
        sum(p.numel() for p in policy.params)


def test_full_and_adapter_checkpoints_do_not_load_into_each_other(gpt2, tmp_path):
    full, _ = make_policy(gpt2, lora=False)
    full.save_checkpoint(str(tmp_path / "full"))
    policy, _ = make_policy(gpt2)
    with pytest.raises(RuntimeError, match="holds no LoRA adapter"):
        policy.load_checkpoint(str(tmp_path / "full"))
    policy.save_checkpoint(str(tmp_path / "adapters"))
    with pytest.raises(RuntimeError, match="holds LoRA adapters only .* load it with policy.lora enabled"):
        full.load_checkpoint(str(tmp_path / "adapters"))


def test_target_and_exclude_modules(gpt2):
    policy, _ = make_policy(gpt2, overrides=("policy.lora.target_modules=[c_attn]", "policy.lora.rank=4",
                                             "policy.lora.exclude_modules=[h.1.attn.c_attn]"))
    adapted = sorted({n.split(".lora_")[0] for n, _ in policy.model.named_parameters() if ".lora_A." in n})
    assert adapted == ["transformer.h.0.attn.c_attn"]
    assert sum(p.numel() for p in policy.params) == 4 * (64 + 192)  # r x in + out x r for c_attn 64 -> 192
    with pytest.raises(ConfigError, match=r"policy.lora.target_modules: \['q_proj'\] match no linear layer of the "
                                          r"model; its linear layers are named c_attn, c_fc, c_proj, lm_head"):
        make_policy(gpt2, overrides=("policy.lora.target_modules=[q_proj]",))
    with pytest.raises(ConfigError, match="policy.lora.exclude_modules: excludes every targeted layer"):
        make_policy(gpt2, overrides=("policy.lora.target_modules=[c_attn]", "policy.lora.exclude_modules=[c_attn]"))


def test_dropout_acts_in_the_training_forward_only(gpt2):
    from grpo_sdk.backends.hf.forward import sequence_logprobs

    plain, cfg = make_policy(gpt2)
    data = trained(plain, cfg)  # B is no longer zero, so the adapters' input dropout shows
    policy, _ = make_policy(gpt2, overrides=("policy.lora.dropout=0.5",))
    policy.model.load_state_dict(plain.model.state_dict())
    torch.testing.assert_close(policy.logprobs(data), plain.logprobs(data), rtol=0, atol=0)  # no-grad: no dropout
    with torch.enable_grad():
        noisy = sequence_logprobs(policy.model, data.input_ids, data.attention_mask, temperature=1.0, top_k=None,
                                  top_p=1.0, token_mask=data.token_mask)
    assert noisy.requires_grad and not torch.allclose(noisy, plain.logprobs(data), atol=1e-4)


def test_the_run_plan_counts_no_reference_copy_and_no_full_gradients_with_lora():
    from grpo_sdk.cli.plan import make_plan
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins.registry import Registry

    registry = Registry.discover()
    full = make_plan(load_config(None, ["loss_fn.reference_policy_kl_penalty=0.05"], registry), registry)
    plan = make_plan(load_config(None, ["loss_fn.reference_policy_kl_penalty=0.05", "policy.lora.enabled=true"],
                                 registry), registry)
    params = plan.model.params
    assert full.memory_bytes["reference_model"] == 4 * params and "reference_model" not in plan.memory_bytes
    assert plan.memory_bytes["gradients"] == plan.memory_bytes["adamw_moments"] == 0
    assert 0 < plan.memory_bytes["lora_adapters"] < full.memory_bytes["gradients"]  # the adapters' states only
    text = plan.render()
    assert "the base with the adapters off, no copy" in text and "LoRA adapters (policy.lora)" in text


def test_missing_peft_is_a_plugin_error_with_the_install_line(monkeypatch):
    from grpo_sdk.backends.hf.config import HFPolicyConfig, check_policy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins.registry import Registry

    cfg = load_config(None, ["policy.lora.enabled=true"], Registry.discover())
    assert check_policy(cfg, HFPolicyConfig(), None) == []
    monkeypatch.setitem(sys.modules, "peft", None)  # find_spec (and import) now say: not installed
    with pytest.raises(PluginError, match=r"peft is not installed: .*pip install 'grpo-sdk\[lora\]'") as info:
        check_policy(cfg, HFPolicyConfig(), None)
    assert info.value.exit_code == 3
    from grpo_sdk.backends.hf import lora

    with pytest.raises(PluginError, match=r"pip install 'grpo-sdk\[lora\]'"):
        lora._peft()


def test_missing_peft_exits_3_from_grpoctl(tmp_path):
    code = ("import sys; sys.modules['peft'] = None; from grpo_sdk.cli.entry import main; "
            "sys.exit(main(['config', 'validate', 'policy.lora.enabled=true']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=grpoctl_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "pip install 'grpo-sdk[lora]'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("override, key, message", [
    ("policy.lora.rank=0", "policy.lora.rank", "must be > 0"),
    ("policy.lora.alpha=-1", "policy.lora.alpha", "must be > 0"),
    ("policy.lora.dropout=1.0", "policy.lora.dropout", "must be < 1"),
    ("policy.lora.sync=adapter", "policy.lora.sync", "lora_adapters"),
])
def test_config_errors_name_the_key_and_exit_2(tmp_path, override, key, message):
    result = run_grpoctl("config", "validate", "policy.lora.enabled=true", override, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert key in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_lora_with_the_megatron_policy_is_refused_naming_the_key():
    # In process: `config validate` with megatron here stops earlier, at megatron-core not installed (exit 3).
    import attrs

    from grpo_sdk.config.checks import check_config
    from grpo_sdk.config.loading import load_config

    from grpo_sdk.plugins.registry import Registry

    cfg = load_config(None, ["policy.lora.enabled=true"], Registry.discover())
    assert check_config(cfg) == []
    megatron = attrs.evolve(cfg, policy=attrs.evolve(cfg.policy, backend="megatron"))
    problems = dict(check_config(megatron))
    assert "implemented by policy.backend=hf only, not 'megatron'" in problems["policy.lora.enabled"]


LORA_RUN = ["grpo.max_num_steps=8", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8",
            "checkpointing.save_period=4", "policy.lora.enabled=true", "loss_fn.reference_policy_kl_penalty=0.01"]


@pytest.mark.slow
def test_a_lora_run_samples_with_the_merged_weights_and_exports_both_ways(tmp_path):
    """hf generation gets the merged weights every step: the sampler's logprobs are the trainer's
    (token_mult_prob_error 1) while the policy moves away from the base (KL to the reference > 0)."""
    import json

    result = run_grpoctl("run", "--run-dir", "run", *LORA_RUN, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "policy/ holds LoRA adapters" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-4 and r["gen_kl_error"] < 1e-6 for r in rows)
    assert rows[0]["kl_penalty"] == 0 and rows[-1]["kl_penalty"] > 1e-4  # the base is the reference
    policy_dir = tmp_path / "run" / "checkpoints" / "step_8" / "policy"
    assert not (policy_dir / "model.safetensors").exists()

    merged = run_grpoctl("export", "run", "merged", cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr
    adapter = run_grpoctl("export", "run", "adapter", "--lora", "adapter", cwd=tmp_path)
    assert adapter.returncode == 0, adapter.stderr
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").eos_token == "<eos>"
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "initial_model").eval()
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, with_adapter(ids).logits, rtol=0, atol=1e-5)
        with with_adapter.disable_adapter():
            assert not torch.allclose(plain(ids).logits, with_adapter(ids).logits, atol=1e-4)
    serve = run_grpoctl("serve", "run", cwd=tmp_path, timeout=120)
    assert serve.returncode == 2 and "holds LoRA adapters only" in serve.stderr and "--step 8" in serve.stderr, \
        serve.stderr
    bad = run_grpoctl("export", "run", "other", "--lora", "both", cwd=tmp_path)
    assert bad.returncode == 2 and "--lora: must be 'merged' or 'adapter'" in bad.stderr


def test_export_of_adapters_from_a_full_checkpoint_is_refused(tmp_path):
    result = run_grpoctl("run", "--run-dir", "run", "grpo.max_num_steps=1", "grpo.num_prompts_per_step=2",
                         "grpo.num_generations_per_prompt=2", "grpo.val_period=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    refused = run_grpoctl("export", "run", "out", "--lora", "adapter", cwd=tmp_path)
    assert refused.returncode == 2 and "is not a LoRA checkpoint" in refused.stderr, refused.stderr
    assert not (tmp_path / "out").exists()


# --- FSDP2 data parallel: two ranks train the adapters as one process does ---------------------


def rank_main(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
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
            torch.save(out, root_dir / f"{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    root = tmp_path_factory.mktemp("lora-fsdp")
    build_tiny_gpt2(root / "gpt2", seed=0)
    build_tiny_llama(root / "llama")
    single = {}
    for name in MODELS:
        policy, cfg = make_policy(root / name, name)
        single[name] = scenario(policy, cfg, root / f"{name}-ckpt-single")
    mp.spawn(rank_main, args=(free_port(), str(root)), nprocs=WORLD, join=True)
    dp = {name: [torch.load(root / f"{name}-rank{r}.pt", weights_only=True) for r in range(WORLD)]
          for name in MODELS}
    for name in MODELS:
        policy, cfg = make_policy(root / name, name)
        policy.load_checkpoint(str(root / f"{name}-ckpt-dp"))
        single[name]["loaded_dp_continued"] = continued(policy, cfg)
    return root, single, dp


@pytest.mark.parametrize("name", list(MODELS))
def test_two_lora_ranks_train_as_one_process(runs, name):
    root, single, dp = runs
    expected = single[name]
    for rank_out in dp[name]:
        torch.testing.assert_close(rank_out["logprobs"], expected["logprobs"], rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_out["reference"], expected["reference"], rtol=0, atol=1e-6)
        for actual, wanted in zip(rank_out["metrics"], expected["metrics"]):
            assert_metrics_equal(actual, wanted)
        assert_weights_equal(rank_out["weights"], expected["weights"])  # merged, base names
        torch.testing.assert_close(rank_out["trained_logprobs"], expected["trained_logprobs"], rtol=0, atol=1e-5)
        assert_metrics_equal(rank_out["continued"]["metrics"], expected["continued"]["metrics"])
        assert_weights_equal(rank_out["continued"]["weights"], expected["continued"]["weights"])
        # Each world resumes from the other's adapter checkpoint.
        assert_metrics_equal(rank_out["loaded_single_continued"]["metrics"], expected["continued"]["metrics"])
        assert_weights_equal(rank_out["loaded_single_continued"]["weights"], expected["continued"]["weights"])
    assert_metrics_equal(expected["loaded_dp_continued"]["metrics"], dp[name][0]["continued"]["metrics"])
    assert_weights_equal(expected["loaded_dp_continued"]["weights"], dp[name][0]["continued"]["weights"])
    assert expected["metrics"][0]["grad_norm"] > 0
    assert not torch.allclose(expected["trained_logprobs"], expected["logprobs"])
    # The group writes what one process writes: adapters and optimizer state only.
    files = sorted(p.name for p in (root / f"{name}-ckpt-dp").iterdir())
    assert files == sorted(p.name for p in (root / f"{name}-ckpt-single").iterdir())
    assert "model.safetensors" not in files and "adapter_model.safetensors" in files


class MergingPolicy:
    """A third-party policy class that merges its own adapters (``ExportsMergedModel``)."""

    calls: list = []

    @staticmethod
    def export_merged(policy_dir: str, out: str) -> None:
        MergingPolicy.calls.append((policy_dir, out))
        Path(out).mkdir()


class AdapterOnlyPolicy:
    """A policy class with adapter checkpoints and no way to merge them."""


@pytest.mark.parametrize("impl", ["MergingPolicy", "AdapterOnlyPolicy"])
def test_export_merges_through_the_runs_own_policy_class(tmp_path, impl):
    """`grpoctl export --lora merged` asks the class of the run's policy.backend (found in the registry,
    no policy built) to merge; a class that cannot is a config error naming --lora adapter."""
    from grpo_sdk.core.protocols import ExportsMergedModel
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.plugins import ComponentInfo, ComponentSpec
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.trainer.checkpoint import export_policy

    assert isinstance(HFPolicy, ExportsMergedModel)  # asked of the class: export builds no policy
    spec = ComponentSpec(name="acme", kind="policy", impl=f"test_lora:{impl}")
    registry = Registry([ComponentInfo(kind="policy", name="acme", status="ok", spec=spec)])
    (tmp_path / "config.resolved.yaml").write_text("policy:\n  backend: acme\n")
    policy = tmp_path / "checkpoints" / "step_2" / "policy"
    policy.mkdir(parents=True)
    (policy / "adapter_config.json").write_text("{}")
    MergingPolicy.calls.clear()
    if impl == "MergingPolicy":
        assert export_policy(tmp_path, tmp_path / "out", registry=registry) == policy
        assert MergingPolicy.calls == [(str(policy), str(tmp_path / "out"))]
    else:
        with pytest.raises(ConfigError, match="cannot merge its adapters.*--lora adapter"):
            export_policy(tmp_path, tmp_path / "out", registry=registry)
        assert not (tmp_path / "out").exists()
