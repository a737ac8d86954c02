"""The ``data``, ``env``, ``weight_sync``, ``logger``, ``checkpointing`` and ``cluster`` sections, and
``MasterConfig``, the whole run configuration that gathers every section."""

from __future__ import annotations

from typing import Any, Literal

import attrs
from attrs import validators as v

from grpo_sdk.config.schema.base import MAX_MMAP_THRESHOLD, MAX_ROWS, MAX_THREADS, MAX_TIMEOUT_S, PluginSlot, internal_field, non_empty, \
    non_negative, positive, raw_blocks_field, row_count, structured_blocks_field, token_count
from grpo_sdk.config.schema.grpo import GRPOConfig, LossConfig, OnPolicyDistillationConfig, RewardPenaltyConfig
from grpo_sdk.config.schema.policy import PolicyConfig
from grpo_sdk.core.options import option


def _ray_gpus(instance: Any, attribute: Any, value: float) -> None:
    # Ray's own rule for a resource amount: a fraction below 1, or whole units.
    if value > 1 and value != int(value):
        raise ValueError(f"{value} GPUs: give a fraction below 1 (a share of one GPU) or a whole number")


def _column_renames(instance: Any, attribute: Any, value: dict[str, str]) -> None:
    # Two columns renamed to one name would silently drop one of them.
    if any(not isinstance(k, str) or not isinstance(t, str) or not k or not t for k, t in value.items()):
        raise ValueError(f"maps column names to new names, both non-empty text: {value!r}")
    targets = list(value.values())
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise ValueError(f"renames several columns to {twice[0]!r}")


# --- data, env ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class DatasetConfig:
    path: str = option(help="A JSONL or Parquet file, a directory saved by datasets' save_to_disk, or a hub "
                       "dataset `hf:NAME` (as data.train_path).")
    weight: float = option(1.0, "Share of each step's prompts drawn from this dataset, relative to the others.",
                           validator=positive)
    prompt_key: str | None = option(None, "Key of the prompt text; null uses data.prompt_key.", validator=non_empty)
    subset: str | None = option(None, "hf: datasets: the subset (configuration) to load; null uses data.subset.",
                                validator=non_empty)
    split: str | None = option(None, "hf: datasets: the split to read; null uses data.split.", validator=non_empty)
    columns: dict[str, str] | None = option(None, "Column renames for this dataset; null uses data.columns.",
                                            validator=v.optional(_column_renames))


@attrs.frozen(kw_only=True)
class DataConfig:
    train_path: str | None = option(None, "Training prompts: a JSONL or Parquet file, a directory saved by "
                                    "datasets' save_to_disk, or a dataset loaded with datasets.load_dataset: "
                                    "`hf:NAME` (a hub id such as hf:openai/gsm8k, or a local directory laid out "
                                    "like a hub dataset repo); null: the environment generates prompts "
                                    "(synthetic tasks).")
    validation_path: str | None = option(None, "Validation prompts, in the same formats; null: the environment "
                                         "generates them (synthetic tasks) or there is no validation.")
    subset: str | None = option(None, "hf: datasets: the subset (configuration) to load, e.g. 'main' for "
                                "hf:openai/gsm8k; null: the dataset's only or default one.", validator=non_empty)
    split: str = option("train", "hf: datasets: the split data.train_path is read from.", validator=non_empty)
    validation_split: str = option("test", "hf: datasets: the split data.validation_path is read from ('test': "
                                   "what most hub datasets, GSM8K and MATH among them, ship beside 'train').",
                                   validator=non_empty)
    revision: str | None = option(None, "hf: hub datasets: the branch, tag or commit to load; a commit pins the "
                                  "rows, so a resume reads exactly what the run started on (a resume from other "
                                  "rows is refused). Null: the default branch.", validator=non_empty)
    columns: dict[str, str] = option(factory=dict, help="Rename the dataset's columns before use, any format, e.g. "
                                     "{question: prompt, answer: target}; a column the data lacks is an error "
                                     "naming the columns it has.", validator=_column_renames)
    streaming: bool = option(False, "hf: datasets: stream the rows instead of downloading the dataset whole; "
                             "needs data.max_rows, since the prompts are read once at start-up (and again on "
                             "resume, the same first rows).")
    max_rows: int | None = option(None, "Use only the first this many rows of each training dataset (file or "
                                  "stream order, before shuffling); null: every row.", validator=v.optional(row_count))
    prompt_key: str = option("prompt", "Key of the prompt text in each row; the other keys are passed "
                             "to the environment as metadata.", validator=non_empty)
    prompt_template: str | None = option(None, "Python format string wrapped around the prompt, e.g. "
                                         "'Question: {prompt} Answer:'; null uses the prompt as is.")
    system_prompt: str | None = option(None, "System message put before the prompt when the chat template is used.")
    use_chat_template: bool = option(False, "Build the prompt with the tokenizer's chat template (a user "
                                     "message, plus system_prompt), ending with the generation prompt.")
    max_input_seq_length: int | None = option(None, "Longest prompt in tokens; null: "
                                              "max_total_sequence_length - max_new_tokens.",
                                              validator=v.optional(token_count))
    filter_long_prompts: bool = option(False, "Drop prompts longer than max_input_seq_length when the dataset is "
                                       "loaded (and count them); false: such a prompt is an error naming its row.")
    shuffle: bool = option(True, "Shuffle the dataset every epoch (seeded by grpo.seed).")
    num_workers: int = option(1, "Processes that tokenize the dataset when it is loaded.",
                              validator=[positive, v.le(MAX_THREADS)])
    use_multiple_dataloader: bool = option(False, "Mix the datasets listed in data.datasets by their weights "
                                           "instead of reading data.train_path.")
    datasets: list[DatasetConfig] = option(factory=list, help="The training datasets to mix when "
                                           "use_multiple_dataloader is true.")


@attrs.frozen(kw_only=True)
class EnvConfig:
    __plugin__ = PluginSlot.of("environment")

    name: str = option("reverse_digits", "Environment that scores responses, a name in the "
                       "grpo_sdk.environments group.")
    on_reward_error: Literal["raise", "mask"] = option("raise", "When the environment raises or returns a "
                                                       "non-finite reward for a sample: `raise` stops the run "
                                                       "naming the sample; `mask` drops the sample from the loss "
                                                       "and counts it in reward/num_failed.")
    max_failed_fraction: float = option(0.5, "With on_reward_error=mask: stop the run when more than this "
                                        "fraction of the samples of the last failed_window_steps steps failed "
                                        "(a step whose every sample failed always stops it).",
                                        validator=[v.ge(0.0), v.le(1.0)])
    failed_window_steps: int = option(10, "Steps over which max_failed_fraction is measured.",
                                      validator=[positive, v.le(MAX_ROWS)])
    max_concurrent_calls: int = option(0, "Environment calls in flight at once during a rollout. 0: one "
                                       "step() call for every episode of a turn, made once the whole turn is "
                                       "generated (what a reward model batching on a GPU wants). N > 0: one call "
                                       "per prompt group, made as soon as the group's samples are generated, at "
                                       "most N at a time on a thread pool (slow graders, sandboxes, remote "
                                       "judges); step() must then be thread-safe. An environment that runs on "
                                       "the main thread always gets one call per turn. docs/environments.md.",
                                       validator=[v.ge(0), v.le(MAX_THREADS)])
    raw_blocks: dict[str, Any] = raw_blocks_field()
    structured_blocks: dict[str, Any] = structured_blocks_field()


# --- infrastructure -------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WeightSyncConfig:
    __plugin__ = PluginSlot.of("weight_sync")

    backend: str = option("inprocess", "Weight-sync transport, a name in the grpo_sdk.weight_sync group.")
    raw_blocks: dict[str, Any] = raw_blocks_field()
    structured_blocks: dict[str, Any] = structured_blocks_field()


@attrs.frozen(kw_only=True)
class LoggerConfig:
    __plugin__ = PluginSlot.of("logger")

    log_dir: str = option("runs", "Parent directory of run directories (grpoctl run --run-dir overrides).")
    loggers: list[str] = option(factory=lambda: ["jsonl"], help="Metric sinks, names in the grpo_sdk.loggers group.")
    dump_train_data: bool = option(False, "Write every step's training batch (prompts, responses, token ids, masks, "
                                   "rewards, advantages, logprobs) to <run_dir>/train_data/step_N.jsonl.")
    raw_blocks: dict[str, Any] = raw_blocks_field()
    structured_blocks: dict[str, Any] = structured_blocks_field()


@attrs.frozen(kw_only=True)
class CheckpointingConfig:
    enabled: bool = option(True, "Write checkpoints (policy as safetensors with config and tokenizer, optimizer, "
                           "RNG and dataloader state) every save_period steps and at the end.")
    checkpoint_dir: str | None = option(None, "Where checkpoints go; null: <run_dir>/checkpoints.")
    save_period: int = option(10, "Save every this many steps.", validator=positive)
    keep_top_k: int | None = option(3, "Keep the k best checkpoints by metric_name (plus always the latest, for "
                                    "resume); null keeps all.")
    metric_name: str | None = option("val:accuracy", "Metric that ranks checkpoints, prefixed train: or val:; "
                                     "null ranks by step (newest best).")
    higher_is_better: bool = option(True, "Whether a larger metric_name is better.")
    checkpoint_must_save_by: str | None = option(None, "Wall-clock budget 'DD:HH:MM:SS' (or 'HH:MM:SS') from the "
                                                 "start of this process: save and exit before it runs out.")
    save_optimizer: bool = option(True, "Include the optimizer state (needed for an exact resume).")
    load_replay_buffer: bool = option(True, "Async GRPO, on resume: restore the finished prompt groups the "
                                      "checkpoint holds for the coming steps; false discards them and regenerates "
                                      "them with the checkpoint's weights (valid, but with schedule=deterministic "
                                      "no longer bit-identical to an uninterrupted run). The synchronous loop has "
                                      "no buffer.")


@attrs.frozen(kw_only=True)
class ClusterConfig:
    runtime: Literal["local", "ray"] = option("local", "Where components run: `local` is one process; `ray` runs "
                                             "the policy, generation and environments as Ray actors.")
    address: str | None = option(None, "Ray: the cluster to join ('auto', or 'host:port'); null starts a local one.")
    num_nodes: int = option(1, "Ray: nodes the run uses; its workers go to them in contiguous blocks, one per "
                                   "node. More than 1 needs cluster.address.", validator=positive)
    gpus_per_node: int = option(0, "Ray: GPUs per node the run may use; 0 runs on CPUs.", validator=non_negative)
    cpus_per_worker: float = option(1.0, "Ray: CPUs reserved by each worker actor.", validator=positive)
    policy_workers: int = option(1, "Ray: ranks of the policy worker group (torch.distributed; FSDP2 shards "
                                 "parameters, gradients and optimizer state over them).", validator=positive)
    generation_workers: int = option(1, "Ray: generation replicas; each samples a share of every batch.",
                                     validator=positive)
    env_workers: int = option(1, "Ray: environment actors; each scores a share of every batch.", validator=positive)
    env_max_concurrency: int = option(4, "Ray: environment calls in flight per environment actor.", validator=positive)
    env_gpus_per_worker: float = option(0.0, "Ray: GPUs each environment actor takes (a reward model's), outside the "
                                        "policy's and generation's bundles: a fraction below 1 shares a GPU between "
                                        "actors (0.5: two per GPU), a larger amount is whole GPUs. 0: CPU only (the "
                                        "actor's context.device is then cpu).", validator=[non_negative, _ray_gpus])
    call_timeout_s: float = option(1800.0, "Deadline of every call into an environment in this process, and (Ray) "
                                   "of every remote call; a call that does not return in time stops the run with "
                                   "an error naming the worker or the sample (no silent hangs).",
                                   validator=[positive, v.le(MAX_TIMEOUT_S)])
    startup_timeout_s: float = option(600.0, "Ray: deadline for workers to start and load their models.",
                                      validator=[positive, v.le(MAX_TIMEOUT_S)])
    device: Literal["auto", "cpu", "cuda"] = option("auto", "Torch device; auto picks cuda when available.")
    num_threads: int | None = option(1, "torch.set_num_threads for the run (and in every worker); null keeps "
                                     "torch's default. One thread is fastest for small models on shared CPUs.",
                                     validator=v.optional(v.and_(positive, v.le(MAX_THREADS))))
    malloc_mmap_threshold: int | None = option(
        None, "glibc (Linux): bytes from which every C allocation gets its own mapping, returned to the OS when "
        "freed (mallopt M_MMAP_THRESHOLD), while the policy trains and computes logprobs: in the run's process "
        "around those phases (sampling keeps a fixed 32 MiB threshold, where its short-lived blocks are reused), in "
        "a Ray policy worker throughout. null keeps glibc's own threshold, which rises as blocks are freed and then "
        "keeps freed tensors resident: peak RSS grows step after step past what is live (docs/benchmarks.md, "
        "\"Memory plan\"). 1048576 bounds the peak near the live memory. No effect elsewhere.",
        validator=v.optional(v.and_(positive, v.le(MAX_MMAP_THRESHOLD))))
    release_freed_memory: bool = option(
        True, "glibc (Linux): after every step, give the pages the step freed back to the OS (malloc_trim), so "
        "the heap does not carry one step's holes into the next: a lower peak over a long run (SmolLM2's recipe, "
        "40 steps: 6,335 against 7,072 MiB), though not below what a step's own holes add (docs/benchmarks.md, "
        "\"Memory plan\"). In the trainer's process only: with "
        "cluster.runtime=ray the workers' heaps are their own (cluster.malloc_mmap_threshold reaches them). "
        "No effect elsewhere.")


@attrs.frozen(kw_only=True)
class MasterConfig:
    """The whole run configuration."""

    policy: PolicyConfig = option(help="The trained model, its optimizer and its generation settings.")
    grpo: GRPOConfig = option(factory=GRPOConfig, help="Algorithm: batch shape, steps, advantage estimator.")
    loss_fn: LossConfig = option(factory=LossConfig, help="Clipped policy-gradient loss.")
    on_policy_distillation: OnPolicyDistillationConfig = option(factory=OnPolicyDistillationConfig,
                                                                help="The teacher of the opd estimator.")
    data: DataConfig = option(factory=DataConfig, help="Training prompts.")
    env: EnvConfig = option(factory=EnvConfig, help="Environment that scores responses.")
    weight_sync: WeightSyncConfig = option(factory=WeightSyncConfig, help="Policy -> generation weight transport.")
    logger: LoggerConfig = option(factory=LoggerConfig, help="Run directory and metric sinks.")
    checkpointing: CheckpointingConfig = option(factory=CheckpointingConfig, help="Checkpoints.")
    cluster: ClusterConfig = option(factory=ClusterConfig, help="Devices and runtime.")
    reward_penalties: RewardPenaltyConfig = option(factory=RewardPenaltyConfig, help="Reward-zeroing penalties "
                                                   "on the generated messages (NeMo-RL's).")
    extra_sections: dict[str, Any] = internal_field()


def plugin_config(section: Any, name: str | None = None) -> Any:
    """The structured config block of the selected plugin of a pluggable section."""
    slot: PluginSlot = type(section).__plugin__
    return section.structured_blocks.get(name if name is not None else getattr(section, slot.selector))
