"""Rules that span config fields, checked after structuring and before any model is loaded.

Each rule returns a problem naming the keys involved; all problems are reported together. These
replace the seed's bare ``assert``s, which ``python -O`` would have dropped, and several of the
seed's silent no-ops (a switch set where nothing reads it) are errors here.
"""

from __future__ import annotations

from typing import Any

from grpo_sdk.core import config as C


def check_batch_shape(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    problems = []
    rollout_rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    global_rows = cfg.policy.train_global_batch_size
    if global_rows is not None:
        if global_rows <= 0:
            problems.append(("policy.train_global_batch_size", f"must be > 0: {global_rows}"))
        elif rollout_rows % global_rows:
            problems.append(("policy.train_global_batch_size",
                             f"{global_rows} must divide the rollout batch (grpo.num_prompts_per_step x "
                             f"grpo.num_generations_per_prompt = {rollout_rows})"))
    gen = cfg.policy.generation
    if gen.max_new_tokens >= cfg.policy.max_total_sequence_length:
        problems.append(("policy.generation.max_new_tokens",
                         f"{gen.max_new_tokens} leaves no room for a prompt within "
                         f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length}"))
    max_in = cfg.data.max_input_seq_length
    if max_in is not None and max_in + gen.max_new_tokens > cfg.policy.max_total_sequence_length:
        problems.append(("data.max_input_seq_length",
                         f"{max_in} + policy.generation.max_new_tokens={gen.max_new_tokens} exceeds "
                         f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length}"))
    if gen.top_k is not None and gen.top_k < 0:
        problems.append(("policy.generation.top_k", f"must be >= 0 or null: {gen.top_k}"))
    return problems


def check_rewards(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    grpo, problems = cfg.grpo, []
    scaling, shaping = grpo.reward_scaling, grpo.reward_shaping
    if scaling.enabled and scaling.source_max <= scaling.source_min:
        problems.append(("grpo.reward_scaling.source_max",
                         f"must be greater than grpo.reward_scaling.source_min ({scaling.source_min})"))
    if shaping.enabled:
        coef = shaping.stop_properly_penalty_coef
        if coef is not None:
            if not 0 <= coef <= 1:
                problems.append(("grpo.reward_shaping.stop_properly_penalty_coef", f"must be in [0, 1]: {coef}"))
        else:
            if shaping.overlong_buffer_length is None or shaping.overlong_buffer_length <= 0:
                problems.append(("grpo.reward_shaping.overlong_buffer_length",
                                 "DAPO overlong shaping needs a buffer length > 0 (or set stop_properly_penalty_coef)"))
            if shaping.overlong_buffer_penalty is None or shaping.overlong_buffer_penalty < 0:
                problems.append(("grpo.reward_shaping.overlong_buffer_penalty",
                                 "DAPO overlong shaping needs a penalty >= 0 (or set stop_properly_penalty_coef)"))
            max_length = shaping.max_response_length or cfg.policy.generation.max_new_tokens
            if shaping.overlong_buffer_length and shaping.overlong_buffer_length > max_length:
                problems.append(("grpo.reward_shaping.overlong_buffer_length",
                                 f"{shaping.overlong_buffer_length} exceeds the max response length {max_length}"))
    if grpo.batch_multiplier != 1 and not grpo.use_dynamic_sampling:
        problems.append(("grpo.batch_multiplier",
                         f"{grpo.batch_multiplier} needs grpo.use_dynamic_sampling=true (it must be 1 otherwise)"))
    if grpo.use_dynamic_sampling and int(grpo.num_prompts_per_step * grpo.batch_multiplier) < 1:
        problems.append(("grpo.batch_multiplier", "draws no prompts: num_prompts_per_step x batch_multiplier < 1"))
    low, high = grpo.advantage_clip_low, grpo.advantage_clip_high
    if low is not None and high is not None and low > high:
        problems.append(("grpo.advantage_clip_low", f"{low} is above grpo.advantage_clip_high ({high})"))
    threshold = grpo.seq_logprob_error_threshold
    if threshold is not None and threshold < 1:
        problems.append(("grpo.seq_logprob_error_threshold",
                         f"{threshold} would drop every sample: the error exp(|dlogp|) is at least 1"))
    return problems


def check_algorithm(cfg: C.MasterConfig, registry: Any) -> list[tuple[str, str]]:
    """Loss options against each other, and against the estimator's declared capabilities."""
    from grpo_sdk.algorithms.loss_checks import check_loss_config

    loss, grpo, problems = cfg.loss_fn, cfg.grpo, []
    problems += check_loss_config(loss, grpo.seq_logprob_error_threshold)
    rollout_rows = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    if loss.force_on_policy_ratio and cfg.policy.train_global_batch_size not in (None, rollout_rows):
        problems.append(("loss_fn.force_on_policy_ratio",
                         "requires policy.train_global_batch_size == grpo.num_prompts_per_step x "
                         f"grpo.num_generations_per_prompt ({rollout_rows}) or null: one optimizer step per rollout"))
    if grpo.skip_reference_policy_logprobs_calculation and loss.reference_policy_kl_penalty != 0:
        problems.append(("grpo.skip_reference_policy_logprobs_calculation",
                         "requires loss_fn.reference_policy_kl_penalty == 0 (the KL needs reference logprobs)"))
    info = registry.info("estimator", grpo.adv_estimator.name) if registry is not None else None
    capabilities = info.spec.capabilities if info is not None and info.spec is not None else frozenset()
    if info is not None and info.spec is not None:
        if loss.use_kl_in_reward and "kl_in_reward" not in capabilities:
            problems.append(("loss_fn.use_kl_in_reward",
                             f"estimator {grpo.adv_estimator.name!r} does not fold a KL into its advantages, so the "
                             "KL penalty would silently vanish; use reinforce_plus_plus or unset it"))
        if loss.seq_logprob_error_in_loss and "prev_logprobs" in capabilities:
            problems.append(("loss_fn.seq_logprob_error_in_loss",
                             f"skips the old-logprob pass that estimator {grpo.adv_estimator.name!r} needs"))
        teacher = cfg.on_policy_distillation.teacher_model
        if "teacher_logprobs" in capabilities and not teacher:
            problems.append(("on_policy_distillation.teacher_model",
                             f"estimator {grpo.adv_estimator.name!r} needs a teacher model directory"))
        if teacher and "teacher_logprobs" not in capabilities:
            problems.append(("on_policy_distillation.teacher_model",
                             f"is set, but estimator {grpo.adv_estimator.name!r} uses no teacher "
                             "(select grpo.adv_estimator.name=opd, or unset it)"))
    if cfg.on_policy_distillation.teacher_model and registry is not None:
        backend = cfg.on_policy_distillation.teacher_backend
        if registry.info("policy", backend) is None:
            problems.append(("on_policy_distillation.teacher_backend", f"no policy backend named {backend!r}"))
    return problems


def check_lifecycle(cfg: C.MasterConfig, registry: Any) -> list[tuple[str, str]]:
    """Data, validation and checkpointing."""
    grpo, data, ckpt, problems = cfg.grpo, cfg.data, cfg.checkpointing, []
    info = registry.info("environment", cfg.env.name) if registry is not None else None
    generates = info is not None and info.spec is not None and "generates_prompts" in info.spec.capabilities
    if data.use_multiple_dataloader:
        if not data.datasets:
            problems.append(("data.datasets", "is empty, but data.use_multiple_dataloader is true"))
        if data.train_path:
            problems.append(("data.train_path", "is ignored when data.use_multiple_dataloader is true; unset one"))
    elif data.datasets:
        problems.append(("data.datasets", "is set, but data.use_multiple_dataloader is false"))
    elif not data.train_path and info is not None and not generates:
        problems.append(("data.train_path", f"is required: environment {cfg.env.name!r} does not generate prompts"))
    validating = grpo.val_period > 0 or grpo.val_at_start or grpo.val_at_end
    if validating and not data.validation_path and info is not None and not generates:
        # Name only the switches that are on, so the fix is exactly those.
        on = [f"grpo.val_period={grpo.val_period}"] if grpo.val_period > 0 else []
        on += [f"grpo.{key}=true" for key in ("val_at_start", "val_at_end") if getattr(grpo, key)]
        off = ["grpo.val_period=0" if key.startswith("grpo.val_period") else key.replace("=true", "=false")
               for key in on]
        problems.append(("data.validation_path",
                         f"is required when validation is on ({', '.join(on)}): environment {cfg.env.name!r} does "
                         f"not generate prompts; set {' '.join(off)} to train without validation"))
    if grpo.stop_at_validation_metric is not None and grpo.stop_at_validation_threshold is None:
        problems.append(("grpo.stop_at_validation_threshold", "must be set with grpo.stop_at_validation_metric"))
    if grpo.stop_at_validation_metric == "pass_k" and grpo.val_num_generations_per_prompt <= 1:
        problems.append(("grpo.stop_at_validation_metric",
                         "'pass_k' needs grpo.val_num_generations_per_prompt > 1"))
    if ckpt.keep_top_k is not None and ckpt.keep_top_k < 1:
        problems.append(("checkpointing.keep_top_k", f"must be >= 1 or null: {ckpt.keep_top_k}"))
    if ckpt.metric_name is not None and not ckpt.metric_name.startswith(("train:", "val:")):
        problems.append(("checkpointing.metric_name", f"{ckpt.metric_name!r} must start with train: or val:"))
    if ckpt.checkpoint_must_save_by is not None:
        try:
            parse_duration(ckpt.checkpoint_must_save_by)
        except ValueError as exc:
            problems.append(("checkpointing.checkpoint_must_save_by", str(exc)))
    return problems


def check_runtime(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """cluster.*: the Ray runtime's worker counts against the batch and the devices; Ray-only keys
    set for the local runtime. Reads installed metadata only: never imports ray."""
    import importlib.metadata as md

    c, problems = cfg.cluster, []
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    if c.runtime != "ray":
        for key in ("policy_workers", "generation_workers", "env_workers"):
            if getattr(c, key) > 1:
                problems.append((f"cluster.{key}", f"{getattr(c, key)} workers need cluster.runtime=ray (the local "
                                 "runtime runs one of each in this process)"))
        if c.address:
            problems.append(("cluster.address", "is set, but cluster.runtime is local; set cluster.runtime=ray"))
        if c.num_nodes > 1:
            problems.append(("cluster.num_nodes", f"{c.num_nodes} nodes need cluster.runtime=ray"))
        return problems
    try:
        md.version("ray")
    except md.PackageNotFoundError:
        problems.append(("cluster.runtime", "ray is not installed: pip install 'grpo-sdk[ray]'"))
    n, m = c.policy_workers, c.generation_workers
    if rows % n:
        problems.append(("cluster.policy_workers", f"{n} ranks must divide the rollout batch "
                         f"(grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rows}): each rank "
                         "trains an equal share"))
    global_rows = cfg.policy.train_global_batch_size
    if global_rows is not None and global_rows > 0 and global_rows % n:
        problems.append(("policy.train_global_batch_size", f"{global_rows} must be divisible by "
                         f"cluster.policy_workers ({n}): each rank trains an equal share of every optimizer step"))
    if m > rows:
        problems.append(("cluster.generation_workers", f"{m} replicas for a rollout batch of {rows} rows would leave "
                         "some idle; use at most as many replicas as rows"))
    if c.num_nodes > 1 and not c.address:
        problems.append(("cluster.num_nodes", f"{c.num_nodes} nodes need an existing cluster (cluster.address); "
                         "a local Ray cluster has one node"))
    colocated = cfg.policy.generation.colocated.enabled
    if c.gpus_per_node > 0:
        gpus = c.num_nodes * c.gpus_per_node
        needed = max(n, m) if colocated else n + m
        if needed > gpus:
            how = ("colocated: max(policy_workers, generation_workers)" if colocated
                   else "non-colocated: policy_workers + generation_workers, one GPU each")
            problems.append(("cluster.gpus_per_node", f"{gpus} GPUs (num_nodes x gpus_per_node) are too few: this run "
                             f"needs {needed} ({how})"))
        if c.device == "cpu":
            problems.append(("cluster.device",
                             "is cpu, but cluster.gpus_per_node > 0 reserves GPUs no worker would use"))
    elif c.device == "cuda":
        problems.append(("cluster.gpus_per_node", "is 0, but cluster.device=cuda: Ray workers get GPUs only "
                         "through their bundles; set cluster.gpus_per_node"))
    return problems


def _weight_sync_capabilities(name: str, registry: Any) -> frozenset[str]:
    """The selected transport's declared capabilities (the built-in specs when there is no registry)."""
    info = registry.info("weight_sync", name) if registry is not None else None
    if info is not None and info.spec is not None:
        return info.spec.capabilities
    from grpo_sdk.weight_sync import specs

    builtin = {spec.name: spec for spec in (specs.INPROCESS, specs.DISK, specs.COLLECTIVE, specs.CUDA_IPC)}
    return builtin[name].capabilities if name in builtin else frozenset()


def check_weight_sync(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """weight_sync.* against the runtime and devices, from the transport's declared capabilities:
    ``ray_workers`` (it runs code in the Ray workers) needs cluster.runtime=ray; ``cuda_ipc`` needs
    GPUs, colocated generation with a policy rank on every replica's GPU, and a generation backend
    that declares ``cuda_ipc``. Never imports ray or torch."""
    from grpo_sdk.weight_sync.specs import CollectiveWeightSyncConfig

    name, c, problems = cfg.weight_sync.backend, cfg.cluster, []
    capabilities = _weight_sync_capabilities(name, registry)
    gpus = c.gpus_per_node > 0 and c.device != "cpu"
    colocated = cfg.policy.generation.colocated.enabled
    if "cuda_ipc" in capabilities:
        missing = []
        if c.runtime != "ray":
            missing.append("cluster.runtime=ray (it runs in the Ray workers)")
        if not gpus:
            missing.append("GPUs (cluster.gpus_per_node > 0 and cluster.device not cpu)")
        if not colocated:
            missing.append("policy.generation.colocated.enabled=true (a generation replica shares the GPU of "
                           "the policy rank it copies from)")
        elif c.generation_workers > c.policy_workers:
            missing.append(f"a policy rank on every replica's GPU: cluster.generation_workers "
                           f"({c.generation_workers}) <= cluster.policy_workers ({c.policy_workers})")
        gen = cfg.policy.generation.backend
        info = registry.info("generation", gen) if registry is not None else None
        if info is not None and info.spec is not None and "cuda_ipc" not in info.spec.capabilities:
            missing.append(f"a generation backend that declares the cuda_ipc capability ({gen!r} does not)")
        if missing:
            problems.append(("weight_sync.backend", f"{name!r} shares GPU memory between processes on one GPU; it "
                             f"needs {'; '.join(missing)}. Otherwise use collective or disk"))
    elif "ray_workers" in capabilities and c.runtime != "ray":
        problems.append(("weight_sync.backend", f"{name!r} moves weights between Ray workers: it needs "
                         "cluster.runtime=ray. In one process use weight_sync.backend=inprocess (or disk)"))
    block = cfg.weight_sync.configs.get(name)
    if isinstance(block, CollectiveWeightSyncConfig) and block.backend == "nccl":
        if not gpus:
            problems.append(("weight_sync.collective.backend", "nccl needs GPUs (cluster.gpus_per_node > 0 and "
                             "cluster.device not cpu); use gloo or auto"))
        elif colocated:
            problems.append(("weight_sync.collective.backend", "nccl cannot put two ranks on one GPU, and with "
                             "colocated generation policy rank 0 shares its GPU with generation replica 0; use "
                             "gloo (auto picks it) or weight_sync.backend=cuda_ipc"))
    return problems


def parse_duration(text: str) -> float:
    """Seconds in 'DD:HH:MM:SS' or 'HH:MM:SS'."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{text!r} is not 'DD:HH:MM:SS' or 'HH:MM:SS'")
    values = [int(p) for p in parts]
    if len(values) == 3:
        values.insert(0, 0)
    days, hours, minutes, seconds = values
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def check_config(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """Every cross-field problem of ``cfg``; ``registry`` enables the capability checks."""
    return (check_batch_shape(cfg) + check_rewards(cfg) + check_algorithm(cfg, registry)
            + check_lifecycle(cfg, registry) + check_runtime(cfg, registry)
            + check_weight_sync(cfg, registry))
