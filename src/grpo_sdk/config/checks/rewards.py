"""Which ``reward_penalties.*`` and ``grpo.length_penalty.*`` settings go together (light: no torch).

NeMo-RL checks the unwanted-token ids in its config validator and the think-tag ids at the first
rollout; a malformed global length band is a pydantic error there. Here each is a problem naming
its key, reported with every other problem by `grpoctl config validate`, before a model loads.
How the config reads (is the length penalty active, which bands apply) lives here too, shared with
the transform (``grpo_sdk.algorithms.length_penalty``).
"""

from __future__ import annotations

import attrs

from grpo_sdk.config.schema import LengthPenaltyConfig, MasterConfig

CHANNELS = ("reasoning", "answer", "total")
_AMOUNTS = ("reasoning_bonus", "answer_bonus", "total_bonus", "longest_reasoning_penalty", "longest_answer_penalty",
            "longest_total_penalty", "group_reasoning_length_penalty_coeff", "group_answer_length_penalty_coeff",
            "group_total_length_penalty_coeff", "profiled_length_penalty", "pass_rate_length_penalty_weight")


def global_bands(cfg: LengthPenaltyConfig) -> dict[str, dict[str, float]]:
    """``profile_band.defaults`` channels that are set, when ``profile_band.enabled``."""
    if not cfg.profile_band.enabled:
        return {}
    return {ch: attrs.asdict(band) for ch in CHANNELS
            if (band := getattr(cfg.profile_band.defaults, ch)).a is not None}


def band_switches(cfg: LengthPenaltyConfig) -> dict[str, bool]:
    """``default.profile_band_<channel>``; null means on exactly when a global band of that channel is set."""
    bands = global_bands(cfg)
    return {ch: (ch in bands) if getattr(cfg.default, f"profile_band_{ch}") is None
            else bool(getattr(cfg.default, f"profile_band_{ch}")) for ch in CHANNELS}


def length_penalty_active(cfg: LengthPenaltyConfig) -> bool:
    """Whether any reward can change: enabled, and some amount non-zero or some band switched on."""
    p = cfg.default
    zmad = any(getattr(p, f"{ch}_zmad_threshold") > 0 and getattr(p, f"{ch}_zmad_penalty") > 0 for ch in CHANNELS)
    return p.enabled and (any(getattr(p, k) > 0 for k in _AMOUNTS) or zmad or any(band_switches(cfg).values()))


def check_reward_penalties(cfg: MasterConfig) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    penalties, ids = cfg.reward_penalties, cfg.reward_penalties.token_ids
    if penalties.penalize_unwanted_tokens and not ids.unwanted:
        problems.append(("reward_penalties.token_ids.unwanted",
                         "must list at least one token id when reward_penalties.penalize_unwanted_tokens is true, "
                         "e.g. reward_penalties.token_ids.unwanted=[151643]"))
    if (ids.think_open is None) != (ids.think_close is None):
        missing, given = ("think_close", "think_open") if ids.think_close is None else ("think_open", "think_close")
        problems.append((f"reward_penalties.token_ids.{missing}",
                         f"must be set too, since reward_penalties.token_ids.{given} is: give both think-tag ids, "
                         "or neither (then they are read from the tokenizer when each of "
                         "reward_penalties.thinking_tags is one token)"))
    elif ids.think_open is not None and ids.think_open == ids.think_close:
        problems.append(("reward_penalties.token_ids.think_close",
                         f"is reward_penalties.token_ids.think_open's id too ({ids.think_open}): the tags must differ"))
    problems += _check_bands(cfg)
    if length_penalty_active(cfg.grpo.length_penalty) and cfg.grpo.adv_estimator.name == "gdpo":
        # gdpo builds advantages from the components, which the length penalty leaves raw (and it needs two
        # or more, where the length penalty changes single-reward environments only).
        problems.append(("grpo.length_penalty.default.enabled",
                         "has no effect with grpo.adv_estimator.name=gdpo: the length penalty changes single-"
                         "component 0/1 rewards only, and gdpo reads the components; set it to false, or use grpo "
                         "or rloo"))
    return problems


def _check_bands(cfg: MasterConfig) -> list[tuple[str, str]]:
    problems = []
    for channel in ("total", "reasoning", "answer"):
        band = getattr(cfg.grpo.length_penalty.profile_band.defaults, channel)
        key = f"grpo.length_penalty.profile_band.defaults.{channel}"
        values = {"a": band.a, "b": band.b, "f": band.f}
        unset = [name for name, value in values.items() if value is None]
        if unset and len(unset) < 3:
            problems.append((f"{key}.{unset[0]}", f"must be set with {key}'s other fields: a band needs a, b and f"))
        elif not unset and band.b <= band.a:
            problems.append((f"{key}.b", f"must be greater than {key}.a ({band.a:g}): {band.b:g}"))
        elif not unset and not 0 <= band.f <= 1:
            problems.append((f"{key}.f", f"must be in [0, 1], or longer rollouts would score higher or below 0: "
                                         f"{band.f:g}"))
    return problems
