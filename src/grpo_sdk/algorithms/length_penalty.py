"""NeMo-RL's per-prompt-group length bonuses and penalties (``grpo.length_penalty``), on 0/1 rewards.

Among a group's successes, shorter is rewarded: flat bonuses and penalties for the shortest and
longest, a dense zero-centred term, modified-z outliers, a pass-rate-scaled term, a profiled-length
threshold and multiplicative length bands. Lengths are of the reasoning (inside the think tags),
the answer (after them) and their total, over a sample's generated messages. A group whose valid
rewards are not all 0 or 1, or an environment with several reward components, is left alone
(counted in ``length_penalty/skipped_non_binary_frac``), and no reward drops below 0 nor changes
sign: an all-wrong group stays variance-free.

The math is NeMo-RL's ``apply_group_length_penalties`` (NVIDIA-NeMo/RL ``nemo_rl/utils/length_penalty.py``),
on ``group_ids`` instead of contiguous NeMo-Gym rows; its test numbers are pinned in
tests/unit/test_reward_penalties.py. Not carried over: ``agent_overrides`` (NeMo-Gym agents) and ``verbose``.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from grpo_sdk.config.schema import LengthPenaltyConfig, LengthPenaltyParams
from grpo_sdk.config.checks.rewards import CHANNELS, band_switches, global_bands, length_penalty_active

__all__ = ["apply_length_penalty", "length_penalty_active", "band_multiplier", "length_weights", "zmad_outliers"]

BINARY_TOLERANCE = 1e-6
ZMAD_MIN_MAD_REL = 0.015  # a MAD below 1.5% of the median is noise, not spread (upstream's floor)


def band_multiplier(length: float, band: Any) -> float:
    """1 up to ``a``, linear down to ``f`` at ``b``, ``f`` beyond; 1 for a missing or malformed band."""
    if not isinstance(band, dict):
        return 1.0
    a, b, f = band.get("a"), band.get("b"), band.get("f")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b, f)) or b <= a:
        return 1.0
    if length <= a:
        return 1.0
    if length >= b:
        return float(f)
    return 1.0 - (length - a) / (b - a) * (1.0 - float(f))


def length_weights(lengths: Sequence[float]) -> list[float]:
    """Zero-centred weights, shorter higher: ``w = 1 - (L - min) / (max - min)`` minus its mean; all 0
    when the lengths are equal."""
    low, high = min(lengths), max(lengths)
    if high == low:
        return [0.0] * len(lengths)
    raw = [1.0 - (x - low) / (high - low) for x in lengths]
    mean = sum(raw) / len(raw)
    return [w - mean for w in raw]


def zmad_outliers(lengths: Sequence[float], threshold: float) -> set[int]:
    """Positions whose Iglewicz-Hoaglin modified z-score ``0.6745 (L - median) / MAD`` exceeds ``threshold``."""
    if len(lengths) < 2:
        return set()
    median = statistics.median(lengths)
    mad = statistics.median([abs(x - median) for x in lengths])
    if mad == 0 or mad / max(median, 1e-9) < ZMAD_MIN_MAD_REL:
        return set()
    return {k for k, x in enumerate(lengths) if 0.6745 * (x - median) / mad > threshold}


def group_adjustments(rewards: Sequence[float], lengths: dict[str, Sequence[float]], p: LengthPenaltyParams,
                      coefficients: bool = True) -> list[float]:
    """The additive terms of one group: bonuses, longest penalties, the dense term (unless the profile gate
    closed it: ``coefficients`` False) and the zMAD outliers; only successes (reward > 0) take part, and
    nothing happens with fewer than two."""
    n = len(rewards)
    positive = [i for i in range(n) if rewards[i] > 0]
    adjusted, delta = list(rewards), [0.0] * n
    if len(positive) < 2:
        return delta

    def add(i: int, amount: float) -> None:
        adjusted[i] += amount
        delta[i] += amount

    ranked = sorted((rewards[i] for i in positive), reverse=True)
    top = ranked[max(0, int(len(ranked) * p.top_percentile) - 1)]
    top_scorers = [i for i in positive if rewards[i] >= top]
    for ch in CHANNELS:  # the shortest non-empty success, if it is still a top scorer
        bonus = getattr(p, f"{ch}_bonus")
        candidates = [i for i in positive if lengths[ch][i] > 0]
        if bonus > 0 and candidates:
            shortest = min(candidates, key=lambda i: lengths[ch][i])  # the first of equals, as upstream's min
            if adjusted[shortest] >= top:
                add(shortest, bonus)
    for ch in CHANNELS:  # the longest non-empty top scorer, when there are two to compare
        penalty = getattr(p, f"longest_{ch}_penalty")
        candidates = [i for i in top_scorers if lengths[ch][i] > 0]
        if penalty > 0 and len(candidates) >= 2:
            add(max(candidates, key=lambda i: lengths[ch][i]), -penalty)
    coeffs = {ch: getattr(p, f"group_{ch}_length_penalty_coeff") if coefficients else 0.0 for ch in CHANNELS}
    if any(c > 0 for c in coeffs.values()):
        weights = {ch: length_weights([lengths[ch][i] for i in positive]) for ch in CHANNELS}
        for k, i in enumerate(positive):
            add(i, sum(weights[ch][k] * coeffs[ch] for ch in CHANNELS))
    for ch in CHANNELS:
        threshold, penalty = getattr(p, f"{ch}_zmad_threshold"), getattr(p, f"{ch}_zmad_penalty")
        if threshold > 0 and penalty != 0:
            for k in zmad_outliers([lengths[ch][i] for i in positive], threshold):
                add(positive[k], -penalty)
    return delta


def gate_open(band: dict[str, Any] | None, p: LengthPenaltyParams, rewards: Sequence[float],
              lengths: dict[str, Sequence[float]]) -> bool:
    """The profile gate: the group's mean length (successes only, by default) above its band's field."""
    if not p.group_length_penalty_profile_gate:
        return True
    limit = (band or {}).get(p.group_length_penalty_profile_gate_channel)
    limit = limit.get(p.group_length_penalty_profile_gate_field) if isinstance(limit, dict) else None
    if not isinstance(limit, (int, float)) or isinstance(limit, bool):
        return False
    chosen = lengths[p.group_length_penalty_profile_gate_channel]
    values = [x for r, x in zip(rewards, chosen) if r > 0 or not p.group_length_penalty_profile_gate_positive_only]
    return bool(values) and statistics.mean(values) > limit


def profiled_threshold(meta: dict[str, Any], p: LengthPenaltyParams) -> float | None:
    """mean + n_std x std of the passing profiled lengths of a prompt, or None (too few passed)."""
    scores, lengths = meta.get("profiled_rewards"), meta.get("profiled_output_lengths")
    if scores is None or lengths is None:
        return None
    passing = [float(length) for score, length in zip(scores, lengths) if score > 0]
    if len(passing) < p.profiled_length_min_samples or not passing:
        return None
    spread = statistics.stdev(passing) if len(passing) >= 2 else 0.0
    return statistics.mean(passing) + p.profiled_length_n_std * spread


def apply_length_penalty(rewards: Sequence[float], groups: Sequence[Sequence[int]],
                         lengths: dict[str, Sequence[float]], metadata: Sequence[dict[str, Any]],
                         cfg: LengthPenaltyConfig, single_component: bool = True
                         ) -> tuple[list[float], dict[str, float]]:
    """New rewards of every row, and the ``length_penalty/*`` metrics (per-row means over all rows).

    ``groups`` lists the rows of each prompt group (rows in no group are untouched: failed rewards);
    ``lengths`` maps each of ``CHANNELS`` to a length per row; ``metadata`` holds each row's data keys
    (``profile_band``, ``profiled_rewards``, ``profiled_output_lengths``, read from a group's first row).
    """
    p, out = cfg.default, [float(r) for r in rewards]
    bands, switches = global_bands(cfg), band_switches(cfg)
    wiped = skipped = 0
    for rows in groups:
        original = [out[i] for i in rows]
        if not single_component or any(min(abs(r), abs(r - 1.0)) > BINARY_TOLERANCE for r in original):
            skipped += len(rows)
            continue
        local = {ch: [lengths[ch][i] for i in rows] for ch in CHANNELS}
        first = metadata[rows[0]] if metadata else {}
        row_band = first.get("profile_band")
        band = {**bands, **row_band} if isinstance(row_band, dict) else dict(bands)
        delta = group_adjustments(original, local, p, coefficients=gate_open(band, p, original, local))
        if p.profiled_length_penalty > 0 and (threshold := profiled_threshold(first, p)) is not None:
            for k in range(len(rows)):  # not stacked on a row the group terms already penalized
                if local["total"][k] >= threshold and delta[k] >= 0:
                    delta[k] -= p.profiled_length_penalty
        winners = [k for k in range(len(rows)) if original[k] > 0]
        if p.pass_rate_length_penalty_weight > 0 and winners:
            longest = max(local["total"][k] for k in winners)
            if longest > 0:
                for k in winners:
                    delta[k] -= (p.pass_rate_length_penalty_weight * len(winners) / len(rows)
                                 * local["total"][k] / longest)
        for k, i in enumerate(rows):
            reward = max(0.0, original[k] + delta[k])  # may wipe a success out, never flip its sign
            if original[k] > 0 and reward > 0:
                for ch in ("total", "reasoning", "answer"):  # upstream's order, so the products round alike
                    if switches[ch]:
                        reward *= band_multiplier(local[ch][k], band.get(ch))
            wiped += original[k] > 0 and reward <= 0
            out[i] = reward
    n = max(len(out), 1)
    changes = [new - float(old) for new, old in zip(out, rewards)]
    return out, {
        "length_penalty/env_reward_mean": sum(float(r) for r in rewards) / n,
        "length_penalty/reward_delta_mean": sum(changes) / n,
        "length_penalty/bonus_mean": sum(c for c in changes if c > 0) / n,
        "length_penalty/penalty_mean": sum(c for c in changes if c < 0) / n,
        "length_penalty/wiped_correct_frac": wiped / n,
        "length_penalty/adjusted_frac": sum(c != 0 for c in changes) / n,
        "length_penalty/skipped_non_binary_frac": skipped / n,
    }
