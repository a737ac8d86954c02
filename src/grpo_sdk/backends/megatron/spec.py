"""Entry-point target of the megatron backend (light: no torch, megatron or mbridge import here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_sdk.plugins import ComponentSpec
from grpo_sdk.plugins.toolkit import model_facts

POLICY = ComponentSpec(
    name="megatron",
    kind="policy",
    impl="grpo_sdk.backends.megatron.policy:MegatronPolicy",
    config="grpo_sdk.backends.megatron.config:MegatronPolicyConfig",
    check="grpo_sdk.backends.megatron.spec:check_megatron",
    requires=("torch", "transformers", "megatron-core>=0.16.1", "mbridge>=0.15.1"),
    extra="megatron",
    summary="Megatron-Core GPTModel built from a Hugging Face model through mbridge: tensor and data "
            "parallelism, vocab-parallel logprobs, HF-format checkpoints (CPU-tested; not yet run on a GPU).",
)

# The causal-LM architectures (config.json model_type) mbridge 0.15.1 registers a bridge for:
# mbridge/models/{llama,qwen2,qwen3,mixtral,qwen2moe,qwen3moe,deepseek_v3}.py, each `@register_model("...")`
# (line 6-18 of each file). mbridge also registers glm4_moe, mimo, gemma3 and vision-language models
# (qwen2_5_vl, glm4v, glm4v_moe, internvl_chat); this backend does not offer them yet.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _on_cpu(cluster: Any) -> bool:
    """Whether the policy runs without CUDA, known without importing torch."""
    if cluster.device != "auto":
        return cluster.device == "cpu"
    if cluster.runtime == "ray":
        return cluster.gpus_per_node == 0
    return not Path("/dev/nvidiactl").exists()  # auto picks cuda only where an NVIDIA driver is loaded


def _model_shape(model_name: str) -> tuple[str, dict[str, Any]] | None:
    """``(where, config)`` with model_type, heads and layers of a model known without torch; None for a
    hub name (its config.json is not here until the run downloads it)."""
    return model_facts(model_name)  # a built-in model's too: builtin:tiny-llama is a Llama


def _count(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_megatron(config: Any, options: Any, registry: Any) -> list[tuple[str, str]]:
    """Every problem of ``policy.megatron`` against the cluster and the model, each with its key path."""
    key = "policy.megatron"
    tp, pp, cp = (options.tensor_model_parallel_size, options.pipeline_model_parallel_size,
                  options.context_parallel_size)
    problems: list[tuple[str, str]] = []
    world = config.cluster.policy_workers
    if world % (tp * pp * cp):
        problems.append((f"{key}.tensor_model_parallel_size",
                         f"tensor x pipeline x context parallel sizes ({tp} x {pp} x {cp} = {tp * pp * cp}) must "
                         f"divide the policy's world size, cluster.policy_workers ({world}): each data-parallel "
                         "replica spans that many ranks"))
    if options.expert_model_parallel_size > 1 and world % options.expert_model_parallel_size:
        problems.append((f"{key}.expert_model_parallel_size",
                         f"{options.expert_model_parallel_size} must divide cluster.policy_workers ({world})"))
    if options.sequence_parallel and tp == 1:
        problems.append((f"{key}.sequence_parallel",
                         "needs tensor_model_parallel_size > 1: sequence parallelism shards activations over the "
                         "tensor-parallel group; set policy.megatron.sequence_parallel=false or raise "
                         "policy.megatron.tensor_model_parallel_size"))
    if _on_cpu(config.cluster):
        why = "needs CUDA, and this run's policy is on CPU (cluster.device)"
        for flag in ("apply_rope_fusion", "bias_activation_fusion"):
            if getattr(options, flag):
                problems.append((f"{key}.{flag}", f"must be false on CPU: the fused kernel {why}"))
        if cp > 1:
            problems.append((f"{key}.context_parallel_size",
                             f"must be 1 on CPU: context-parallel attention {why}"))
    facts = _model_shape(config.policy.model_name)
    if facts is not None:
        where, model = facts
        model_type = model.get("model_type")
        if model_type not in ARCHITECTURES:
            problems.append(("policy.model_name",
                             f"{where} is model_type {model_type!r}, which the megatron backend cannot build: "
                             f"mbridge 0.15.1 bridges {', '.join(ARCHITECTURES)}; use policy.backend=hf for it"))
        heads = _count(model, "num_attention_heads")
        kv_heads = _count(model, "num_key_value_heads") or heads
        layers = _count(model, "num_hidden_layers")
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count is not None and count % tp:
                problems.append((f"{key}.tensor_model_parallel_size",
                                 f"{tp} must divide the model's {name} ({count}, {where}): tensor parallelism "
                                 "splits the heads evenly over the ranks"))
        if layers is not None and layers % pp:
            problems.append((f"{key}.pipeline_model_parallel_size",
                             f"{pp} must divide the model's num_hidden_layers ({layers}, {where}): each pipeline "
                             "stage holds an equal share of the layers"))
    problems += _not_built(options, world // tp if world % tp == 0 else 1)
    # policy.generation.backend=megatron against this policy: check_megatron_generation (the generation's).
    return problems


def _not_built(options: Any, data_parallel: int) -> list[tuple[str, str]]:
    """What the megatron policy does not run yet: refused here, before a run starts, rather than when the
    policy is built (config.NOT_BUILT says why for each)."""
    from grpo_sdk.backends.megatron.config import NOT_BUILT

    set_keys = [name for name in ("pipeline_model_parallel_size", "context_parallel_size",
                                  "expert_model_parallel_size") if getattr(options, name) != 1]
    if options.sequence_parallel:
        set_keys.append("sequence_parallel")
    if options.use_distributed_optimizer and data_parallel > 1:
        set_keys.append("use_distributed_optimizer")
    return [(f"policy.megatron.{name}", f"{getattr(options, name)}: not supported by the megatron policy yet: "
             f"{NOT_BUILT[name]}") for name in set_keys]


GENERATION = ComponentSpec(
    name="megatron",
    kind="generation",
    impl="grpo_sdk.backends.megatron.generation:MegatronGeneration",
    check="grpo_sdk.backends.megatron.spec:check_megatron_generation",
    requires=("torch", "transformers", "megatron-core>=0.16.1", "mbridge>=0.15.1"),
    extra="megatron",
    summary="Sampling on a Megatron-Core GPTModel with Megatron-Core's KV cache; colocated in one process it "
            "runs on the megatron policy's own weights (CPU-tested; not yet run on a GPU).",
)


def check_megatron_generation(config: Any, options: Any, registry: Any) -> list[tuple[str, str]]:
    """``policy.generation.backend=megatron`` against the policy, the runtime and async GRPO."""
    from grpo_sdk.backends.megatron.colocated import shares_policy_model

    problems: list[tuple[str, str]] = []
    gen = config.policy.generation
    if gen.colocated.enabled and config.policy.backend != "megatron":
        problems.append(("policy.generation.backend",
                         f"'megatron' with policy.generation.colocated.enabled=true needs policy.backend=megatron "
                         f"(it is {config.policy.backend!r}): colocated megatron generation runs on the megatron "
                         "policy's own model. Set policy.backend=megatron, or policy.generation.colocated."
                         "enabled=false (a model of its own, refit with the policy's weights in Hugging Face "
                         "names)"))
    if shares_policy_model(config) and config.grpo.async_grpo.enabled:
        problems.append(("grpo.async_grpo.enabled",
                         "must be false with colocated megatron generation (policy.generation.backend=megatron, "
                         "colocated.enabled=true, cluster.runtime=local): it samples on the weights the policy "
                         "trains in place, so a step taken while a response is sampled would change them "
                         "mid-response. Set policy.generation.colocated.enabled=false for async GRPO"))
    if config.policy.backend != "megatron":  # with the megatron policy its own check says this
        facts = _model_shape(config.policy.model_name)
        model_type = facts[1].get("model_type") if facts is not None else None
        if facts is not None and model_type not in ARCHITECTURES:
            problems.append(("policy.model_name",
                             f"{facts[0]} is model_type {model_type!r}, which megatron generation cannot build: "
                             f"mbridge 0.15.1 bridges {', '.join(ARCHITECTURES)}"))
    return problems
