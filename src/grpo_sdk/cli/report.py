"""Plots and a markdown summary of a finished (or running, or crashed) run, from its metrics.jsonl.

``grpoctl report RUN_DIR [--out DIR]`` calls ``write_report``; library users can too::

    from grpo_sdk.cli.report import write_report
    result = write_report("runs/grpo-20250101-120000")
    result.files   # [.../report/reward.png, ..., .../report/report.md]

It reads ``RUN_DIR/metrics.jsonl`` (written by the ``jsonl`` logger, so that logger must be on)
and ``RUN_DIR/summary.json`` when the run got that far, and writes into ``RUN_DIR/report/``:
``reward.png``, ``kl.png``, ``response_length.png``, ``timing.png``, ``validation.png`` (each
skipped, with a note in the summary, when the run logged none of its metrics) and ``report.md``,
which embeds them with relative links. An async run (docs/async.md) also gets ``async.png`` and an
"Async pipeline" section (``grpo_sdk.cli.report_async``); a sync run gets neither, and no note. A
multi-turn run (docs/multi-turn.md) gets ``episodes.png`` and an "Episodes" section: turns per
episode and tool-call rates.

Needs matplotlib (``pip install 'grpo-sdk[report]'``), imported only here and only when a report
is written, so the CLI stays light. Errors: no matplotlib is a ``PluginError`` (a missing
optional requirement, exit 3); a missing, empty or unreadable metrics.jsonl is a ``ReportError``
(a bad RUN_DIR argument, exit 2).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.cli import report_async
from grpo_sdk.core.errors import ExitCode, GrpoSdkError, PluginError

TIMING_KEYS = ("timing/rollout", "timing/exposed_generation", "timing/logprobs", "timing/train",
               "timing/refit_bubble", "timing/weight_sync")
"""The step phases ``timing.png`` stacks first, in the order a step runs them (a sync run has
``rollout``, an async one ``exposed_generation`` and ``refit_bubble``); other one-level
``timing/*`` keys (but ``timing/step``) follow."""


class ReportError(GrpoSdkError):
    """RUN_DIR has nothing to report: no metrics.jsonl, or no readable record in it."""

    exit_code = ExitCode.USAGE


@attrs.frozen
class Report:
    """What ``write_report`` wrote, and what it left out (``notes``, also listed in report.md)."""

    out_dir: Path
    files: list[Path]
    notes: list[str]


def _number(value: Any) -> float | None:
    # The jsonl logger writes NaN and infinity as strings ("nan", "inf", "-inf"): read them back.
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:  # a text field some plugin logged: not a metric to plot
            return None
    return None


def load_metrics(path: Path) -> tuple[list[dict[str, float]], int]:
    """Records sorted by step, and how many lines could not be read.

    A resumed run appends to metrics.jsonl and repeats the steps after its checkpoint: the last
    record of a step wins, as it is the one the final weights descend from. A line cut off by a
    crash is skipped rather than failing the whole report.
    """
    if not path.is_file():
        raise ReportError(f"{path} does not exist: not a run directory, or the run did not use the jsonl "
                          f"logger (logger.loggers must include jsonl)")
    by_step: dict[int, dict[str, float]] = {}
    bad = 0
    for ordinal, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if not isinstance(raw, dict):
            bad += 1
            continue
        step = _number(raw.get("step"))
        step = int(step) if step is not None and math.isfinite(step) else ordinal
        record = {k: x for k, v in raw.items() if k != "step" and (x := _number(v)) is not None}
        by_step[step] = {"step": float(step), **record}
    if not by_step:
        raise ReportError(f"{path} holds no metrics yet ({bad} unreadable lines): the run logged no step")
    return [by_step[s] for s in sorted(by_step)], bad


def series(records: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    """Steps and values of ``key`` over the records that have it; infinities become NaN (gaps)."""
    steps, values = [], []
    for record in records:
        if key in record:
            steps.append(record["step"])
            value = record[key]
            values.append(value if math.isfinite(value) else math.nan)
    return steps, values


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over the finite values of the last ``window`` points (NaN where none)."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1):i + 1] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def _import_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PluginError("grpoctl report needs matplotlib: pip install 'grpo-sdk[report]'") from exc


# --- plots (matplotlib's object API: no pyplot, so no global backend or figure state) ---------


def _figure(rows: int = 1, cols: int = 1, height: float = 3.2):
    from matplotlib.figure import Figure  # PNGs are rendered by the Agg backend; no display needed

    fig = Figure(figsize=(8 if cols == 1 else 11, 0.6 + height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, squeeze=False)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    return fig, axes.flat


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path


def _keys_with_prefix(records: list[dict[str, float]], prefix: str) -> list[str]:
    return sorted({k for r in records for k in r if k.startswith(prefix)})


def _plot_reward(records, path):
    steps, mean = series(records, "reward/mean")
    if not steps:
        return None, "reward.png skipped: no reward/mean metric"
    fig, (ax,) = _figure()
    window = max(1, min(50, len(steps) // 10))
    ax.plot(steps, mean, color="C0", alpha=0.35, lw=1, label="reward/mean")
    ax.plot(steps, rolling_mean(mean, window), color="C0", lw=2, label=f"rolling mean ({window} steps)")
    std_steps, std = series(records, "reward/std")
    if std_steps == steps:  # only a band where every point has both
        ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                        color="C0", alpha=0.12, label="± reward/std")
    ax.set_title("Reward")
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path), None


def _plot_lines(records, path, keys: list[str], title: str, skip: str):
    keys = [k for k in keys if any(k in r for r in records)]
    if not keys:
        return None, skip
    fig, axes = _figure(rows=len(keys), height=2.2)
    for i, (ax, key) in enumerate(zip(axes, keys)):
        steps, values = series(records, key)
        ax.plot(steps, values, color=f"C{i}", lw=1.5, marker="." if len(steps) <= 50 else None)
        ax.set_ylabel(key, fontsize="small")
    fig.suptitle(title)
    return _save(fig, path), None


def _plot_kl(records, path):
    return _plot_lines(records, path, ["kl_penalty", "gen_kl_error", "token_mult_prob_error"],
                       "KL to the reference, and generation/training mismatch",
                       "kl.png skipped: no kl_penalty, gen_kl_error or token_mult_prob_error metric")


def _plot_response_length(records, path):
    keys = _keys_with_prefix(records, "response_length/")
    keys = sorted(keys, key=lambda k: k != "response_length/mean") + ["truncated_fraction"]
    return _plot_lines(records, path, keys, "Response length",
                       "response_length.png skipped: no response_length/* metric")


def timing_stack(records: list[dict[str, float]]) -> tuple[list[str], list[list[float]]]:
    """The keys ``timing.png`` stacks, in order, and their heights per record.

    Other phases (validation, checkpointing) stack too. Nested keys are left out: a phase's parts
    (timing/rollout/x) would count twice, and the async collector's timeline (timing/collector/*)
    runs concurrently with the trainer's phases, not inside the step's time (async.png shows it).
    Missing or non-finite phases stack as 0 so one bad value does not hide the whole step.
    """
    others = [k for k in _keys_with_prefix(records, "timing/")
              if k not in TIMING_KEYS and k != "timing/step" and k.count("/") == 1]
    keys = [k for k in (*TIMING_KEYS, *others) if any(k in r for r in records)]
    return keys, [[r[k] if math.isfinite(r.get(k, math.nan)) else 0.0 for r in records] for k in keys]


def _plot_timing(records, path):
    keys, heights = timing_stack(records)
    if not keys:
        return None, "timing.png skipped: no timing/* metric"
    fig, (ax,) = _figure()
    steps = [r["step"] for r in records]
    labels = [k.removeprefix("timing/") for k in keys]
    colors = [f"C{i}" for i in range(len(keys))]
    if len(steps) > 100:  # bars are clearer for a few steps, but thousands of them take seconds to draw
        ax.stackplot(steps, *heights, labels=labels, colors=colors, linewidth=0)
    else:
        bottom = [0.0] * len(records)
        for height, label, color in zip(heights, labels, colors):
            ax.bar(steps, height, bottom=bottom, width=0.8, color=color, label=label, linewidth=0)
            bottom = [b + h for b, h in zip(bottom, height)]
    total_steps, total = series(records, "timing/step")
    if total_steps:
        ax.plot(total_steps, total, color="black", lw=1, label="step (total)")
    ax.set_ylabel("seconds")
    ax.set_title("Time per step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return _save(fig, path), None


def _plot_validation(records, path):
    keys = _keys_with_prefix(records, "val/")
    if not keys:
        return None, "validation.png skipped: no val/* metric (validation off, or not reached yet)"
    cols = 1 if len(keys) == 1 else 2
    fig, axes = _figure(rows=math.ceil(len(keys) / cols), cols=cols, height=2.4)
    axes = list(axes)
    for i, (ax, key) in enumerate(zip(axes, keys)):
        steps, values = series(records, key)
        ax.plot(steps, values, color=f"C{i}", marker="o", lw=1.5)
        ax.set_title(key, fontsize="small")
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    fig.suptitle("Validation")
    return _save(fig, path), None


def _plot_async(records, path):
    data = report_async.async_data(records)
    if data is None:  # a sync run: no image and no note, so its report is as before
        return None, None
    fig, axes = _figure(rows=4, height=2.2)
    report_async.draw_async(list(axes), data)
    fig.suptitle("Async pipeline: replay buffer, trajectory age, collector vs exposed wait")
    return _save(fig, path), None


EPISODE_KEYS = ("episode/turns_mean", "episode/assistant_tokens_per_turn", "env/tool_calls_per_turn",
                "episode/invalid_tool_call_rate", "env/tool_error_rate")
"""What ``episodes.png`` and the "Episodes" section show of a multi-turn run (docs/multi-turn.md):
turns, tokens per turn, and, for a tool environment (docs/tools.md), tool calls and their failures."""


def _plot_episodes(records, path):
    if not any("episode/turns_mean" in r for r in records):  # single-turn: no image and no note
        return None, None
    return _plot_lines(records, path, list(EPISODE_KEYS), "Episodes: turns and tool calls", None)


def _episode_section(records) -> list[str]:
    keys = [k for k in EPISODE_KEYS if any(k in r for r in records)]
    if "episode/turns_mean" not in keys:
        return []
    lines = ["## Episodes (mean of the last 10 steps)", "", "| metric | value |", "|---|---|"]
    for key in keys:
        values = [v for v in series(records, key)[1][-10:] if math.isfinite(v)]
        if values:
            lines.append(f"| {key} | {_fmt(sum(values) / len(values))} |")
    return lines + [""]


_PLOTS = {"reward": _plot_reward, "kl": _plot_kl, "response_length": _plot_response_length,
          "timing": _plot_timing, "async": _plot_async, "episodes": _plot_episodes, "validation": _plot_validation}


# --- markdown -------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _cut(text: Any, limit: int = 1000) -> str:
    # repr keeps the example on one line and shows special tokens and whitespace as they are.
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def _markdown(run_dir: Path, records, summary: dict | None, images: dict[str, Path], notes: list[str]) -> str:
    steps, reward = series(records, "reward/mean")
    finite = [(v, s) for s, v in zip(steps, reward) if math.isfinite(v)]
    tail = [v for v, _ in finite[-10:]]
    summary = summary or {}
    rows = [("steps", summary.get("steps", int(records[-1]["step"])))]
    if summary.get("seconds") is not None:
        rows.append(("wall time", f"{summary['seconds']:.1f} s"))
    else:  # a run without summary.json crashed or is still going: the sum of its step times
        rows.append(("wall time (sum of timing/step)",
                     f"{sum(v for v in series(records, 'timing/step')[1] if math.isfinite(v)):.1f} s"))
    if finite:
        best, best_step = max(finite)
        rows += [("reward first", _fmt(finite[0][0])), (f"reward last (mean of last {len(tail)} steps)",
                 _fmt(sum(tail) / len(tail))), ("reward max", f"{_fmt(best)} (step {int(best_step)})")]
    lines = [f"# Run report: {run_dir.name}", "", f"Run directory: `{run_dir}`", "",
             "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    val = [(k, series(records, k)) for k in _keys_with_prefix(records, "val/")]
    if val:
        last = max(s[0][-1] for _, s in val)
        lines += [f"## Validation (latest, step {int(last)})", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v[-1])} |" for k, (s, v) in val if s[-1] == last]
        lines.append("")
    data = report_async.async_data(records)
    if data is not None:
        lines += report_async.markdown_section(report_async.async_summary(data))
    lines += _episode_section(records)
    if images:
        lines += ["## Plots", ""] + [f"![{name}]({path.name})\n" for name, path in images.items()]
    example = summary.get("example")
    if example:
        lines += ["## Example (last step)", "", "```text", f"prompt:   {_cut(example.get('prompt'))}",
                  f"response: {_cut(example.get('response'))}", f"reward:   {example.get('reward')}", "```", ""]
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def _read_summary(path: Path, notes: list[str]) -> dict | None:
    # Only a run that finished writes summary.json; the report works without it.
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        notes.append(f"summary.json ignored: {exc}")
        return None
    return summary if isinstance(summary, dict) else None


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write the PNGs and report.md of ``run_dir`` into ``out_dir`` (default ``run_dir/report``)."""
    run_dir = Path(run_dir)
    records, bad = load_metrics(run_dir / "metrics.jsonl")
    _import_matplotlib()
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    notes = [f"{bad} unreadable line(s) of metrics.jsonl skipped"] if bad else []
    images: dict[str, Path] = {}
    for panel, plot in _PLOTS.items():
        path, note = plot(records, out / f"{panel}.png")
        if path is not None:
            images[panel] = path
        else:  # an image of an earlier report into the same folder would no longer match report.md
            (out / f"{panel}.png").unlink(missing_ok=True)
        if note:
            notes.append(note)
    summary = _read_summary(run_dir / "summary.json", notes)
    markdown = out / "report.md"
    markdown.write_text(_markdown(run_dir, records, summary, images, notes), encoding="utf-8")
    return Report(out_dir=out, files=[*images.values(), markdown], notes=notes)
