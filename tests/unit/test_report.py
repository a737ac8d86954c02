"""`grpoctl report`: PNG plots and report.md from a run's metrics.jsonl.

The metrics are synthetic (50 steps, validation every 10, NaN and infinity written as strings as
the jsonl logger does, a line cut off by a crash) so every plot has something to draw; the real
trainer's output is covered by the end-to-end test in test_loggers.py. Async runs (async.png, the
"Async pipeline" section) are checked on synthetic rows with exactly the keys a real async run
logs, and once on a real short `grpoctl run` with the deterministic schedule.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import run_grpoctl
from grpo_sdk.cli.app import main
from grpo_sdk.cli.report import load_metrics, rolling_mean, timing_stack
from grpo_sdk.cli.report_async import async_data, async_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMAGES = ("reward.png", "kl.png", "response_length.png", "timing.png", "validation.png")


def synthetic_run(run_dir, steps=50, val_every=10, summary=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "reward/mean": 0.1 + 0.015 * step, "reward/std": 0.05,
                  "kl_penalty": 0.001 * step, "gen_kl_error": 1e-4, "token_mult_prob_error": 1.0,
                  "response_length/mean": 40.0 - 0.2 * step, "truncated_fraction": 0.1,
                  "timing/rollout": 0.5, "timing/logprobs": 0.1, "timing/train": 0.3,
                  "timing/weight_sync": 0.05, "timing/step": 1.0}
        if step == 7:
            record["reward/mean"] = "nan"  # as JSONLLogger writes a NaN
        if step == 8:
            record["kl_penalty"] = "inf"
        if step % val_every == 0:
            record.update({"val/accuracy": step / 100, "val/pass@4": min(1.0, step / 50)})
        lines.append(json.dumps(record))
    lines.append('{"step": 51, "reward/me')  # the run was killed mid-write
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({
            "steps": steps, "seconds": 61.5, "reward_first": 0.115, "reward_last": 0.8, "run_dir": str(run_dir),
            "checkpoint": None, "example": {"prompt": "12345>", "response": "54321", "reward": 1.0, "valid": True}}))
    return run_dir


def grpoctl(*argv) -> int:
    try:
        return main([*map(str, argv)])
    except SystemExit as exc:  # main() returns the code; typer may still raise on some paths
        return exc.code


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, f"{path} is only {len(data)} bytes"


def test_report_writes_every_plot_and_a_summary(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path / "run")
    assert grpoctl("report", run_dir) == 0
    out = run_dir / "report"
    for name in IMAGES:
        assert_png(out / name)
    printed = capsys.readouterr()
    assert printed.out.split() == [str(out / n) for n in IMAGES] + [str(out / "report.md")]
    assert "1 unreadable line" in printed.err

    md = (out / "report.md").read_text()
    assert "| steps | 50 |" in md
    assert "| wall time | 61.5 s |" in md
    assert "| reward first | 0.115 |" in md
    assert "| reward max | 0.85 (step 50) |" in md
    # mean of the last 10 steps 41..50: 0.1 + 0.015 * 45.5
    assert "| reward last (mean of last 10 steps) | 0.7825 |" in md
    assert "## Validation (latest, step 50)" in md
    assert "| val/accuracy | 0.5 |" in md and "| val/pass@4 | 1 |" in md
    for name in IMAGES:
        assert f"]({name})" in md  # relative links: the report folder can be moved or zipped as a whole
    assert "'12345>'" in md and "'54321'" in md


def test_report_out_dir_and_no_validation(tmp_path, capsys):
    # 150 steps: timing.png switches from bars to a stacked area past 100 steps.
    run_dir = synthetic_run(tmp_path / "run", steps=150, val_every=1000, summary=False)
    out = tmp_path / "elsewhere"
    out.mkdir()
    (out / "validation.png").write_bytes(PNG_MAGIC)  # from an earlier report: must not outlive it
    assert grpoctl("report", run_dir, "--out", out) == 0
    assert not (run_dir / "report").exists()
    for name in IMAGES[:-1]:
        assert_png(out / name)
    assert not (out / "validation.png").exists()
    md = (out / "report.md").read_text()
    assert "validation.png skipped: no val/* metric" in md
    assert "| wall time (sum of timing/step) | 150.0 s |" in md  # no summary.json: a crashed run
    assert "| steps | 150 |" in md
    assert "validation.png skipped" in capsys.readouterr().err


def test_missing_or_empty_metrics_is_a_usage_error(tmp_path, capsys):
    assert grpoctl("report", tmp_path / "nope") == 2
    assert str(tmp_path / "nope" / "metrics.jsonl") in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert grpoctl("report", tmp_path / "empty") == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl holds no metrics" in err


def test_missing_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    run_dir = synthetic_run(tmp_path / "run", steps=3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert grpoctl("report", run_dir) == 3
    assert "pip install 'grpo-sdk[report]'" in capsys.readouterr().err


def test_load_metrics_reads_strings_and_keeps_the_last_record_of_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "a": 1.0}, {"step": 2, "a": "nan"}, {"step": 3, "a": "-inf", "note": "text"},
            {"step": 2, "a": 5.0}]  # a resumed run repeats step 2: the later record wins
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    records, bad = load_metrics(path)
    assert bad == 0
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["a"] == 5.0
    assert records[2]["a"] == -math.inf and "note" not in records[2]


def test_rolling_mean_skips_non_finite_values():
    out = rolling_mean([1.0, math.nan, 3.0, 5.0], window=2)
    assert out[:2] == [1.0, 1.0] and out[2:] == [3.0, 4.0]
    assert math.isnan(rolling_mean([math.nan], 3)[0])


def test_cli_import_does_not_load_matplotlib():
    code = ("import sys, grpo_sdk.cli.app, grpo_sdk.cli.report\n"
            "print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_report_help(capsys):
    assert grpoctl("report", "--help") == 0
    assert "--out" in capsys.readouterr().out


# --- async runs ---------------------------------------------------------------------------------

ASYNC_TRAINER_PHASES = ["timing/exposed_generation", "timing/logprobs", "timing/train", "timing/refit_bubble",
                        "timing/weight_sync"]


def async_row(step, max_age, groups=8):
    """One step as a deterministic-schedule async run logs it (keys as in a real metrics.jsonl):
    step t trains groups of age min(t - 1, A); the buffer drains over the last A steps (20 steps)."""
    age = min(step - 1, max_age)
    generation = 0.03 + 0.001 * step
    exposed = 0.07 if step == 1 else 0.002  # the first step waits for all of its generation
    row = {"step": step, "reward/mean": 0.02 * step, "train/buffer_size": float(groups * min(max_age, 20 - step)),
           "train/avg_trajectory_age": float(age),
           **{f"train/trajectory_age/{k}": float(k == age) for k in range(max_age + 1)},
           "timing/collector/generation": generation,
           "timing/collector/failed_generation": 0.01 if step == 5 else 0.0,
           "timing/collector/generation_limit_pause": 0.0 if step <= max_age + 1 else 0.04,
           "timing/collector/paused_for_trainer": 0.0,
           "timing/exposed_generation": exposed, "timing/logprobs": 1e-5, "timing/train": 0.035,
           "timing/refit_bubble": 0.003 if step == 9 else 0.0, "timing/weight_sync": 0.0005}
    row["timing/step"] = sum(row[k] for k in ASYNC_TRAINER_PHASES) + 0.004
    return row


def async_run(run_dir, steps=20, max_age=2):
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [async_row(step, max_age) for step in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir, rows


def test_async_run_gets_async_png_and_its_section(tmp_path, capsys):
    run_dir, rows = async_run(tmp_path / "run")
    assert grpoctl("report", run_dir) == 0
    out = run_dir / "report"
    names = ("reward.png", "timing.png", "async.png")
    for name in names:
        assert_png(out / name)
    printed = capsys.readouterr()
    assert printed.out.split() == [str(out / n) for n in names] + [str(out / "report.md")]
    md = (out / "report.md").read_text()
    assert "](async.png)" in md
    section = md[md.index("## Async pipeline"):md.index("## Plots")]
    assert "| max trajectory age (A) | 2 |" in section
    # 18 steps hold 16 groups, then 8 and 0
    assert f"| buffer size (mean, groups) | {(18 * 16 + 8) / 20:.4g} |" in section
    assert f"| trajectory age (mean, steps) | {(0 + 1 + 2 * 18) / 20:.4g} |" in section
    assert "| groups of age 0 (mean fraction) | 0.05 |" in section
    assert "| groups of age 2 (mean fraction) | 0.9 |" in section
    exposed = sum(r["timing/exposed_generation"] for r in rows) / 20
    generation = sum(r["timing/collector/generation"] for r in rows) / 20
    assert f"| exposed generation (mean, trainer waited) | {exposed:.4g} s |" in section
    assert f"| collector generation (mean) | {generation:.4g} s |" in section
    assert f"| collector failed_generation (mean) | {0.01 / 20:.4g} s |" in section
    assert f"| collector generation_limit_pause (mean) | {0.04 * 17 / 20:.4g} s |" in section
    assert f"| generation hidden behind training | {100 * (1 - exposed / generation):.1f} % |" in section


def test_timing_stacks_the_trainer_phases_and_not_the_collector(tmp_path):
    """The collector runs concurrently with training: its seconds are not part of timing/step."""
    _, rows = async_run(tmp_path / "run")
    records, _ = load_metrics(tmp_path / "run" / "metrics.jsonl")
    keys, heights = timing_stack(records)
    assert keys == ASYNC_TRAINER_PHASES
    for i, row in enumerate(rows):
        stacked = sum(h[i] for h in heights)
        assert stacked == pytest.approx(row["timing/step"] - 0.004)
        assert stacked + row["timing/collector/generation"] > row["timing/step"]  # what stacking it would claim
    sync_keys, _ = timing_stack(load_metrics(synthetic_run(tmp_path / "sync") / "metrics.jsonl")[0])
    assert sync_keys == ["timing/rollout", "timing/logprobs", "timing/train", "timing/weight_sync"]


def test_async_plot_data_follows_the_rows(tmp_path):
    run_dir, rows = async_run(tmp_path / "run", steps=12, max_age=11)  # ages up to 11: sorted as numbers
    records, _ = load_metrics(run_dir / "metrics.jsonl")
    data = async_data(records)
    assert data.steps == list(range(1, 13))
    assert list(data.age_fractions) == list(range(12))
    for k, fractions in data.age_fractions.items():
        assert fractions == [r[f"train/trajectory_age/{k}"] for r in rows]
    assert [sum(f[i] for f in data.age_fractions.values()) for i in range(12)] == [1.0] * 12
    assert data.buffer_size == [r["train/buffer_size"] for r in rows]
    assert data.avg_age == [r["train/avg_trajectory_age"] for r in rows] and data.token_age is None
    assert list(data.collector) == ["timing/collector/generation", "timing/collector/failed_generation",
                                    "timing/collector/generation_limit_pause", "timing/collector/paused_for_trainer"]
    assert data.exposed == [r["timing/exposed_generation"] for r in rows]
    # step 1 waited longer than the collector generated (scoring, hand-over): nothing hidden, not negative
    assert data.hidden[0] == 0.0
    assert data.hidden[1:] == pytest.approx([r["timing/collector/generation"] - 0.002 for r in rows[1:]])
    summary = async_summary(data)
    assert summary["max_trajectory_age"] == 11 and 0 < summary["hidden_fraction"] < 1


def test_async_summary_edges(tmp_path):
    run_dir, rows = async_run(tmp_path / "run", steps=3)
    lines = [json.dumps({**r, "timing/collector/generation": "nan"} if r["step"] == 2 else r) for r in rows]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    data = async_data(load_metrics(run_dir / "metrics.jsonl")[0])
    assert math.isnan(data.collector["timing/collector/generation"][1]) and math.isnan(data.hidden[1])
    # steps 1 and 3 only: 1 - (0.07 + 0.002) / (0.031 + 0.033) is negative, so clipped at 0
    assert async_summary(data)["hidden_fraction"] == 0.0
    # an A=0 async run logs the buffer metrics with timing/rollout: a plot, and no hidden share to claim
    a0 = [{"step": s, "train/buffer_size": 0.0, "train/avg_trajectory_age": 0.0, "train/trajectory_age/0": 1.0,
           "timing/rollout": 0.05, "timing/step": 0.1} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a0))
    summary = async_summary(async_data(load_metrics(run_dir / "metrics.jsonl")[0]))
    assert summary["hidden_fraction"] is None and summary["exposed_generation_mean"] is None
    assert grpoctl("report", run_dir) == 0
    assert_png(run_dir / "report" / "async.png")
    assert "| generation hidden behind training | n/a |" in (run_dir / "report" / "report.md").read_text()


def test_sync_run_has_no_async_png_and_a_stale_one_goes(tmp_path):
    run_dir = synthetic_run(tmp_path / "run", steps=5)
    assert async_data(load_metrics(run_dir / "metrics.jsonl")[0]) is None
    out = run_dir / "report"
    out.mkdir()
    (out / "async.png").write_bytes(PNG_MAGIC)  # an earlier report into the same folder
    assert grpoctl("report", run_dir) == 0
    assert not (out / "async.png").exists()
    md = (out / "report.md").read_text()
    assert "## Async pipeline" not in md and "async.png" not in md


def test_report_of_a_real_async_run(tmp_path):
    """`grpoctl run` with A=2 (deterministic): step t trains groups of age min(t - 1, 2)."""
    args = ["--run-dir", "run", "grpo.max_num_steps=6", "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4", "grpo.val_period=0", "checkpointing.enabled=false",
            "grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
            "grpo.async_grpo.max_trajectory_age_steps=2"]
    result = run_grpoctl("run", *args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    report = run_grpoctl("report", run_dir, cwd=tmp_path, timeout=120)
    assert report.returncode == 0, report.stderr
    assert_png(run_dir / "report" / "async.png")
    records, _ = load_metrics(run_dir / "metrics.jsonl")
    data = async_data(records)
    assert list(data.age_fractions) == [0, 1, 2]
    assert data.avg_age == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert [[data.age_fractions[k][i] for k in range(3)] for i in (0, 1, 5)] == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    assert data.buffer_size[-1] == 0.0  # nothing left once the last step took its groups
    assert all(g > 0 for g in data.collector["timing/collector/generation"])
    keys, _ = timing_stack(records)
    assert "timing/exposed_generation" in keys and not any(k.startswith("timing/collector") for k in keys)
    assert "## Async pipeline" in (run_dir / "report" / "report.md").read_text()


def test_multi_turn_run_gets_episodes_png_and_its_section(tmp_path):
    run_dir = synthetic_run(tmp_path / "run", steps=20, summary=False)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]]
    for r in records:  # a tool environment's run: turns grow, invalid calls fall
        r.update({"episode/turns_mean": 1 + r["step"] / 10, "episode/assistant_tokens_per_turn": 12.0,
                  "env/tool_calls_per_turn": 0.5, "episode/invalid_tool_call_rate": 1 / r["step"]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert grpoctl("report", run_dir) == 0
    assert_png(run_dir / "report" / "episodes.png")
    md = (run_dir / "report" / "report.md").read_text()
    assert "## Episodes (mean of the last 10 steps)" in md and "](episodes.png)" in md
    assert "| episode/turns_mean | 2.55 |" in md  # steps 11..20: 1 + 15.5 / 10
    assert "| env/tool_calls_per_turn | 0.5 |" in md and "episode/invalid_tool_call_rate" in md
    assert "env/tool_error_rate" not in md  # not logged: no row


def test_single_turn_run_has_no_episodes_section(tmp_path):
    run_dir = synthetic_run(tmp_path / "run", steps=5)
    assert grpoctl("report", run_dir) == 0
    md = (run_dir / "report" / "report.md").read_text()
    assert "Episodes" not in md and not (run_dir / "report" / "episodes.png").exists()
