"""The async part of ``grpoctl report``: ``async.png`` and the report's "Async pipeline" section.

Only a run that logged async metrics (``train/buffer_size``, ``train/trajectory_age/{k}``,
``timing/exposed_generation``, ``timing/collector/*``: docs/async.md) gets them, so a sync run's
report is what it was. ``async_data(records)`` is the plotted data, ``async_summary(data)`` the
numbers of the section; ``draw_async`` puts the data on four matplotlib axes:

1. ``train/buffer_size``: groups left in the replay buffer after the step took its own;
2. ``train/avg_trajectory_age`` (and ``train/token_age_mean`` when in-flight updates log it);
3. ``train/trajectory_age/{k}`` stacked: which share of the step's groups were ``k`` steps old;
4. the collector's timeline (``timing/collector/*`` stacked) against the trainer's
   ``timing/exposed_generation``: what lies above the line was generated while the trainer was
   busy with something else, which is what async buys.

Pure Python here; matplotlib comes in through the axes the caller made.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

AGE_PREFIX = "train/trajectory_age/"
COLLECTOR_PREFIX = "timing/collector/"
EXPOSED = "timing/exposed_generation"
COLLECTOR_GENERATION = "timing/collector/generation"
# Any one of these marks a run as async: a sync run logs timing/rollout and none of them.
MARKERS = ("train/buffer_size", "train/avg_trajectory_age", EXPOSED, "timing/refit_bubble")


@attrs.frozen
class AsyncData:
    """Per-step series of an async run, aligned on ``steps`` (NaN where a step did not log one).

    ``hidden`` is ``collector generation - exposed wait`` per step, clipped at 0: the seconds of
    generation (and scoring) the trainer did not wait for.
    """

    steps: list[float]
    buffer_size: list[float]
    avg_age: list[float]
    token_age: list[float] | None
    age_fractions: dict[int, list[float]]
    collector: dict[str, list[float]]
    exposed: list[float]
    hidden: list[float]


def _finite(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def _column(records: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] if _finite(r.get(key, math.nan)) else math.nan for r in records]


def _age_of(key: str) -> int | None:
    tail = key.removeprefix(AGE_PREFIX)
    return int(tail) if tail.isdigit() else None


def async_data(records: list[dict[str, float]]) -> AsyncData | None:
    """The series ``async.png`` draws, or None for a run without async metrics (a sync run)."""
    keys = {k for r in records for k in r}
    if not any(k in MARKERS or k.startswith((AGE_PREFIX, COLLECTOR_PREFIX)) for k in keys):
        return None
    # Numerically: train/trajectory_age/10 comes after /9.
    ages = sorted(a for k in keys if k.startswith(AGE_PREFIX) and (a := _age_of(k)) is not None)
    collector = sorted(k for k in keys if k.startswith(COLLECTOR_PREFIX))
    # generation first, so the stack's bottom is the number the exposed wait is compared with.
    collector.sort(key=lambda k: k != COLLECTOR_GENERATION)
    generation, exposed = _column(records, COLLECTOR_GENERATION), _column(records, EXPOSED)
    hidden = [max(0.0, g - e) if math.isfinite(g) and math.isfinite(e) else math.nan
              for g, e in zip(generation, exposed)]
    return AsyncData(
        steps=[r["step"] for r in records], buffer_size=_column(records, "train/buffer_size"),
        avg_age=_column(records, "train/avg_trajectory_age"),
        token_age=_column(records, "train/token_age_mean") if "train/token_age_mean" in keys else None,
        age_fractions={a: _column(records, f"{AGE_PREFIX}{a}") for a in ages},
        collector={k: _column(records, k) for k in collector}, exposed=exposed, hidden=hidden)


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def async_summary(data: AsyncData) -> dict[str, Any]:
    """The section's numbers: means over the steps that logged them (None where none did).

    ``hidden_fraction`` is ``1 - mean exposed / mean collector generation`` over the steps that
    logged both, clipped to [0, 1]: the share of the collector's generation time the trainer spent
    doing something else (0 for the synchronous loop, near 1 when generation is fully overlapped).
    """
    both = [(g, e) for g, e in zip(data.collector.get(COLLECTOR_GENERATION, []), data.exposed)
            if math.isfinite(g) and math.isfinite(e)]
    generation = sum(g for g, _ in both)
    hidden = min(1.0, max(0.0, 1 - sum(e for _, e in both) / generation)) if generation > 0 else None
    return {
        "max_trajectory_age": max(data.age_fractions, default=None),
        "buffer_size_mean": _mean(data.buffer_size),
        "avg_trajectory_age_mean": _mean(data.avg_age),
        "age_fractions_mean": {a: _mean(v) for a, v in data.age_fractions.items()},
        "exposed_generation_mean": _mean(data.exposed),
        "collector_mean": {k: _mean(v) for k, v in data.collector.items()},
        "hidden_fraction": hidden,
    }


def _fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.4g}{unit}"


def markdown_section(summary: dict[str, Any]) -> list[str]:
    """The "Async pipeline" lines of report.md."""
    rows = [("max trajectory age (A)", _fmt(summary["max_trajectory_age"])),
            ("buffer size (mean, groups)", _fmt(summary["buffer_size_mean"])),
            ("trajectory age (mean, steps)", _fmt(summary["avg_trajectory_age_mean"]))]
    rows += [(f"groups of age {a} (mean fraction)", _fmt(v)) for a, v in summary["age_fractions_mean"].items()]
    rows.append(("exposed generation (mean, trainer waited)", _fmt(summary["exposed_generation_mean"], " s")))
    rows += [(f"collector {k.removeprefix(COLLECTOR_PREFIX)} (mean)", _fmt(v, " s"))
             for k, v in summary["collector_mean"].items()]
    hidden = summary["hidden_fraction"]
    rows.append(("generation hidden behind training", "n/a" if hidden is None else f"{100 * hidden:.1f} %"))
    return ["## Async pipeline", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]


def _stack(ax, steps, series: dict[str, list[float]], labels: dict[str, str]) -> None:
    heights = [[v if math.isfinite(v) else 0.0 for v in values] for values in series.values()]
    colors = [f"C{i}" for i in range(len(heights))]
    names = [labels[k] for k in series]
    if len(steps) > 100:  # as timing.png: bars for a few steps, an area for thousands
        ax.stackplot(steps, *heights, labels=names, colors=colors, linewidth=0)
        return
    bottom = [0.0] * len(steps)
    for height, name, color in zip(heights, names, colors):
        ax.bar(steps, height, bottom=bottom, width=0.8, color=color, label=name, linewidth=0)
        bottom = [b + h for b, h in zip(bottom, height)]


def draw_async(axes, data: AsyncData) -> None:
    """Draw the four panels (module docstring) on ``axes`` (four matplotlib axes, shared x)."""
    buffer_ax, age_ax, hist_ax, time_ax = axes
    marker = "." if len(data.steps) <= 50 else None
    buffer_ax.plot(data.steps, data.buffer_size, color="C0", lw=1.5, marker=marker)
    buffer_ax.set_ylabel("buffer (groups)", fontsize="small")
    age_ax.plot(data.steps, data.avg_age, color="C1", lw=1.5, marker=marker, label="avg trajectory age")
    if data.token_age is not None:
        age_ax.plot(data.steps, data.token_age, color="C2", lw=1.5, label="token age (mean)")
    age_ax.set_ylabel("age (steps)", fontsize="small")
    age_ax.legend(loc="best", fontsize="small")
    if data.age_fractions:
        _stack(hist_ax, data.steps, {str(a): v for a, v in data.age_fractions.items()},
               {str(a): f"age {a}" for a in data.age_fractions})
        hist_ax.set_ylim(0, 1.05)
        hist_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    hist_ax.set_ylabel("share of groups", fontsize="small")
    if data.collector:
        _stack(time_ax, data.steps, data.collector,
               {k: "collector " + k.removeprefix(COLLECTOR_PREFIX) for k in data.collector})
    time_ax.plot(data.steps, data.exposed, color="black", lw=1.5, marker=marker,
                 label="exposed generation (trainer waited)")
    hidden = async_summary(data)["hidden_fraction"]
    if hidden is not None:
        time_ax.set_title(f"generation hidden behind training: {100 * hidden:.1f} %", fontsize="small")
    time_ax.set_ylabel("seconds", fontsize="small")
    time_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
