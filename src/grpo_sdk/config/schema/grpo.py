"""The ``grpo`` section (batch shape, steps, estimator, reward shaping and penalties, validation,
async) and ``loss_fn`` / ``on_policy_distillation``: the algorithm's settings."""

from __future__ import annotations

from typing import Any, Literal

import attrs
from attrs import validators as v

from grpo_sdk.config.schema.base import MAX_TIMEOUT_S, PluginSlot, RemovedOption, non_negative, positive, raw_blocks_field, row_count, \
    structured_blocks_field
from grpo_sdk.core.options import option

# --- grpo -----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AdvEstimatorConfig:
    __plugin__ = PluginSlot.of("estimator")

    name: str = option("grpo", "Advantage estimator, a name in the grpo_sdk.estimators group.")
    raw_blocks: dict[str, Any] = raw_blocks_field()
    structured_blocks: dict[str, Any] = structured_blocks_field()


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


# --- reward penalties (top level) and grpo.length_penalty: NeMo-RL's rollout-side reward changes ---


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
    """NeMo-RL's reward-zeroing penalties, for any environment (docs/algorithms.md, Reward penalties)."""

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
    """``grpo.length_penalty.default``: NeMo-RL's LengthPenaltyParams. Lengths are of the reasoning (inside the
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
    training rewards (docs/algorithms.md, The length penalty). NeMo-RL's agent_overrides and verbose are
    NeMo-Gym's and have no equivalent here."""

    default: LengthPenaltyParams = option(factory=LengthPenaltyParams, help="The length-adjustment parameters.")
    profile_band: ProfileBandConfig = option(factory=ProfileBandConfig, help="Global length bands.")


def _effort_bound(instance: Any, attribute: Any, value: int) -> None:
    if value <= 0:
        raise ValueError(f"low_ub must be positive (it divides the response length), got {value}")


@attrs.frozen(kw_only=True)
class EffortLevelsConfig:
    """``grpo.effort_levels``: length shaping of the rewards of low-effort prompts (NeMo-RL's effort
    levels, which it reads from env.nemo_gym): a prompt whose last user message contains
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
                                                 "penalties on 0/1 rewards, training only (NeMo-RL's).")
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
