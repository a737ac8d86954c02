"""`grpoctl report`: PNG plots and report.md from a run's metrics.jsonl.

The metrics are synthetic (50 steps, validation every 10, NaN and infinity written as strings as
the jsonl logger does, a line cut off by a crash) so every plot has something to draw; the real
trainer's output is covered by the end-to-end test in test_loggers.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys


from grpo_sdk.cli.app import main
from grpo_sdk.cli.report import load_metrics, rolling_mean

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
