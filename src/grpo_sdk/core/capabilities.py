"""Capabilities: what a component's spec declares so that config checks and the loop know, without
importing the component, what it needs or offers. Each one is read somewhere (named below); a
capability nothing reads is not one (docs/plugins.md, "Capabilities").

``ComponentSpec(capabilities=...)`` takes members or their string values (``{"generates_prompts"}``)
and refuses an unknown name, or one declared on a kind it does not apply to, with the valid ones.

Example::

    from grpo_sdk.plugins import Capability, ComponentSpec

    SPEC = ComponentSpec(name="countdown", kind="environment", impl="acme.countdown:Countdown",
                         capabilities={Capability.GENERATES_PROMPTS})
    "generates_prompts" in SPEC.capabilities      # True: a StrEnum member equals its value
"""

from __future__ import annotations

import enum
import warnings
from typing import Iterable


class Capability(enum.StrEnum):
    GENERATES_PROMPTS = "generates_prompts"
    """environment: implements ``PromptSampler``, so a run needs no ``data.train_path`` (or
    ``data.validation_path``). Read by the config checks (a dataset is then optional) and the
    contract kit (``sample_prompts`` must be there)."""
    GROUP_BASELINE = "group_baseline"
    """estimator: subtracts a baseline computed over each prompt's group, so
    ``grpo.num_generations_per_prompt=1`` gives all-zero advantages: a config error. Read by the
    config checks."""
    KL_IN_REWARD = "kl_in_reward"
    """estimator: folds the KL penalty into the reward itself; ``loss_fn.use_kl_in_reward=true``
    requires it. Read by the config checks."""
    PREV_LOGPROBS = "prev_logprobs"
    """estimator: needs the training engine's logprobs of the sampled tokens
    (``AdvantageInput.prev_logprobs``), and so cannot be combined with
    ``loss_fn.seq_logprob_error_in_loss``. Read by the config checks."""
    TEACHER_LOGPROBS = "teacher_logprobs"
    """estimator: needs a teacher model's logprobs (``AdvantageInput.teacher_logprobs``); the run
    builds the teacher (``on_policy_distillation.teacher_model``, required) only for such an
    estimator. Read by the config checks and the trainer."""
    MULTI_TURN = "multi_turn"
    """environment: may continue an episode after an assistant turn (``EnvironmentReturn.done``
    False, with observations: the ``MultiTurnEnvironment`` contract). Read by the config checks
    (with ``grpo.max_rollout_turns=1`` every episode ends after its first turn: a warning)."""
    TOOL_CALLS = "tool_calls"
    """environment: offers tools (``DeclaresTools.tool_schemas``, rendered into every prompt's chat
    template) and flags invalid calls ``"invalid_tool_call"``. Read by the config checks
    (``grpo.invalid_tool_call_advantage`` requires it) and the contract kit (``tool_schemas`` must
    be there)."""
    RUNS_AGENTS = "runs_agents"
    """environment: its rollouts are played end to end by agents over the rollout endpoint
    (``RunsAgents.run_agents``, docs/agents.md), not stepped turn by turn. Read by the contract kit
    (``run_agents`` and ``endpoint`` must be there) and the config checks."""
    RAY_WORKERS = "ray_workers"
    """weight_sync: runs its own code in the Ray worker groups (``WorkerGroup``), so it needs
    ``cluster.runtime=ray``. Read by the config checks."""
    CUDA_IPC = "cuda_ipc"
    """generation: can load weights from CUDA IPC handles in its own process (the ``cuda_ipc``
    transport's ``update_weights`` path). Read by the ``cuda_ipc`` transport's config check."""
    RECEIVES_BROADCAST = "receives_broadcast"
    """generation: its engine joins the ``collective`` transport's process group and receives the
    broadcast weights in its own workers (``ReceivesBroadcast``: SGLang's
    ``update_weights_from_distributed``, TensorRT-LLM's collective extension, Dynamo's refit
    routes); the transport then broadcasts tensor by tensor to the engine instead of receiving in
    the generation worker. Read by the ``collective`` transport and the contract kit
    (``ReceivesBroadcast`` must be there)."""
    IN_FLIGHT_WEIGHT_UPDATES = "in_flight_weight_updates"
    """generation: ``update_weights`` during ``generate`` takes effect between decode steps (the
    requests in flight finish under the new weights), reports per-token versions
    (``GenerationOutput.token_weight_versions``) and honours
    ``resume_generation(recompute_kv_cache=)``; the class implements ``PausesForRefit``. So async
    GRPO's refit need not drain it; ``grpo.async_grpo.in_flight_weight_updates=true`` requires it.
    Read by the config checks and the contract kit (``PausesForRefit`` must be there)."""
    LORA_ADAPTERS = "lora_adapters"
    """generation: loads LoRA adapters itself, so weight sync may send the adapter tensors only
    (``policy.lora.sync=adapter``): ``update_weights`` then receives peft's file names
    (``base_model.model.X.lora_A.weight``) and applies ``policy.lora``'s rank and alpha (vLLM's
    LoRA path). Read by the config checks: ``policy.lora.sync=adapter`` requires it."""
    DYNAMIC_BATCHING = "dynamic_batching"
    """policy: honours ``policy.dynamic_batching`` (micro-batches by token budget). Read by the config
    checks: ``policy.dynamic_batching.enabled=true`` needs it."""
    SEQUENCE_PACKING = "sequence_packing"
    """policy: honours ``policy.sequence_packing`` (several sequences per row). Read by the config
    checks: ``policy.sequence_packing.enabled=true`` needs it."""
    LOGPROB_CHUNKS = "logprob_chunks"
    """policy: honours ``policy.logprob_chunk_size`` (logits computed that many positions at a
    time). Read by the config checks: a non-null ``policy.logprob_chunk_size`` needs it."""


CAPABILITY_KINDS: dict[Capability, str] = {
    Capability.GENERATES_PROMPTS: "environment",
    Capability.MULTI_TURN: "environment",
    Capability.TOOL_CALLS: "environment",
    Capability.RUNS_AGENTS: "environment",
    Capability.GROUP_BASELINE: "estimator",
    Capability.KL_IN_REWARD: "estimator",
    Capability.PREV_LOGPROBS: "estimator",
    Capability.TEACHER_LOGPROBS: "estimator",
    Capability.RAY_WORKERS: "weight_sync",
    Capability.CUDA_IPC: "generation",
    Capability.IN_FLIGHT_WEIGHT_UPDATES: "generation",
    Capability.RECEIVES_BROADCAST: "generation",
    Capability.LORA_ADAPTERS: "generation",
    Capability.DYNAMIC_BATCHING: "policy",
    Capability.SEQUENCE_PACKING: "policy",
    Capability.LOGPROB_CHUNKS: "policy",
}
"""The component kind each capability applies to."""

REMOVED_CAPABILITIES: dict[str, str] = {
    "colocated": "every backend may be colocated (policy.generation.colocated.enabled); nothing read it",
    "inprocess": "every generation backend takes update_weights; nothing read it",
    "disk": "the disk transport works with every backend; implement WeightFileLoader to read the file yourself",
    "sleep": "a backend releases memory in finish_generation; nothing read it",
    "collective": "the transport's own name; ray_workers says what it needs",
    "reward_components": "every estimator gets reward_components in its extras; nothing read it",
}
"""Capabilities earlier releases declared and nothing read: accepted with a DeprecationWarning and
dropped, so a plugin that copied them keeps loading (removed in 1.0, docs/compatibility.md)."""


def to_capabilities(values: Iterable[str], kind: str | None = None) -> frozenset[Capability]:
    """``values`` as members; a removed name warns and is dropped, an unknown one (or one for
    another kind) is a ``ValueError`` that lists the valid ones."""
    if isinstance(values, str):
        raise ValueError(f"capabilities must be a set of names, not the string {values!r}")
    out = set()
    for value in values:
        if value in REMOVED_CAPABILITIES and not isinstance(value, Capability):
            warnings.warn(f"capability {value!r} is deprecated and ignored ({REMOVED_CAPABILITIES[value]}); "
                          "drop it from the spec", DeprecationWarning, stacklevel=4)
            continue
        try:
            capability = Capability(value)
        except ValueError:
            valid = ", ".join(sorted(c.value for c in Capability))
            raise ValueError(f"unknown capability {value!r}; the valid ones: {valid}") from None
        if kind is not None and CAPABILITY_KINDS[capability] != kind:
            valid = ", ".join(sorted(c.value for c, k in CAPABILITY_KINDS.items() if k == kind)) or "none"
            raise ValueError(f"capability {capability.value!r} is for {CAPABILITY_KINDS[capability]} components, not "
                             f"{kind} ones (valid for {kind}: {valid})")
        out.add(capability)
    return frozenset(out)
