"""How per-micro-batch loss metrics combine into per-step metrics (every policy backend uses this).

A loss divides each metric by counts of the whole global batch, so micro-batch values *add up*
to the global-batch value. Extremes are the exception: keys ending in ``_min`` or ``_max`` take
the min or max. Across several optimizer steps in one GRPO step, sums are averaged.
"""

from __future__ import annotations


def _combine(key: str, values: list[float]) -> float:
    if key.endswith("_min"):
        return min(values)
    if key.endswith("_max"):
        return max(values)
    return sum(values)


def sum_micro_batches(micro_batches: list[dict[str, float]]) -> dict[str, float]:
    """One optimizer step's metrics from its micro-batches' metrics."""
    keys = {k for m in micro_batches for k in m}
    return {k: _combine(k, [m[k] for m in micro_batches if k in m]) for k in keys}


def average_optimizer_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """One GRPO step's metrics from its optimizer steps' metrics."""
    keys = {k for m in steps for k in m}
    out = {}
    for key in keys:
        values = [m[key] for m in steps if key in m]
        out[key] = _combine(key, values) if key.endswith(("_min", "_max")) else sum(values) / len(values)
    return out
