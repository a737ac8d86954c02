"""Start-up time of `grpoctl --help`, `grpoctl --version` and `import grpo_sdk`, and what they import.

Each command runs as a fresh subprocess, ``--rounds`` times, the three alternated within every
round (help, version, import, help, ...) so that all see the same load on a shared machine; the
first ``--warmup`` rounds are dropped (cold page cache, .pyc writing). Printed per command: the
median, min and max wall time of the subprocess (interpreter start-up included, as a user feels
it). Then ``python -X importtime`` of ``grpoctl --help`` once: the modules with the largest
cumulative and self import times, so a regression names its cause.

``grpoctl`` is the script next to this interpreter when there is one (the installed entry point),
otherwise ``python -m grpo_sdk.cli.entry``. Run from the repo root::

    .venv/bin/python benchmarks/cli_startup.py --rounds 20

The issue's target: ``grpoctl --help`` under 0.25 s (docs/benchmarks.md, "CLI start-up").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_HELP_S = 0.25


def grpoctl() -> list[str]:
    script = Path(sys.executable).parent / "grpoctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "grpo_sdk.cli.entry"]


def commands() -> dict[str, list[str]]:
    return {"grpoctl --help": [*grpoctl(), "--help"], "grpoctl --version": [*grpoctl(), "--version"],
            "python -c 'import grpo_sdk'": [sys.executable, "-c", "import grpo_sdk"]}


def time_once(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return elapsed


def import_times(argv: list[str]) -> list[tuple[str, int, int]]:
    """(module, self us, cumulative us) per module from ``python -X importtime``."""
    if argv[0] != sys.executable:  # the script: run its module under -X importtime instead
        argv = [sys.executable, "-m", "grpo_sdk.cli.entry", *argv[1:]]
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv[1:]], capture_output=True, text=True,
                          check=False)
    rows = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m:
            rows.append((m.group(4), int(m.group(1)), int(m.group(2))))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (each runs every command once)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds run first and dropped")
    parser.add_argument("--top", type=int, default=12, help="modules listed from -X importtime")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    cmds = commands()
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for round_ in range(args.warmup + args.rounds):
        for name, cmd in cmds.items():
            elapsed = time_once(cmd)
            if round_ >= args.warmup:
                times[name].append(elapsed)
    rows = import_times(cmds["grpoctl --help"])
    summary = {
        "python": sys.version.split()[0], "grpoctl": " ".join(grpoctl()), "rounds": args.rounds,
        "load_avg_before": round(load_before, 2), "load_avg_after": round(os.getloadavg()[0], 2),
        "median_s": {name: round(statistics.median(t), 4) for name, t in times.items()},
        "min_s": {name: round(min(t), 4) for name, t in times.items()},
        "max_s": {name: round(max(t), 4) for name, t in times.items()},
        "imports_cumulative_us": sorted(((m, c) for m, _, c in rows), key=lambda r: -r[1])[:args.top],
        "imports_self_us": sorted(((m, s) for m, s, _ in rows), key=lambda r: -r[1])[:args.top],
        "modules_imported": len(rows),
        "torch_imported": any(m == "torch" for m, _, _ in rows),
    }
    help_s = summary["median_s"]["grpoctl --help"]
    summary["help_target_met"] = help_s < TARGET_HELP_S
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"Python {summary['python']}, grpoctl = {summary['grpoctl']}, {args.rounds} rounds after {args.warmup} "
          f"warm-up, load avg {summary['load_avg_before']:.2f} -> {summary['load_avg_after']:.2f}\n")
    width = max(len(n) for n in cmds)
    print(f"{'command':<{width}}  {'median s':>9}  {'min s':>7}  {'max s':>7}")
    for name in cmds:
        print(f"{name:<{width}}  {summary['median_s'][name]:>9.3f}  {summary['min_s'][name]:>7.3f}  "
              f"{summary['max_s'][name]:>7.3f}")
    verdict = "MET" if summary["help_target_met"] else "MISSED"
    print(f"\ngrpoctl --help median {help_s:.3f} s, target < {TARGET_HELP_S} s: {verdict}")
    print(f"\n`python -X importtime` of grpoctl --help (one run, {summary['modules_imported']} modules, "
          f"torch {'IMPORTED' if summary['torch_imported'] else 'not imported'}):")
    print("  largest cumulative (ms):  " + ", ".join(f"{m} {us / 1000:.1f}" for m, us in
                                                     summary["imports_cumulative_us"]))
    print("  largest self (ms):        " + ", ".join(f"{m} {us / 1000:.1f}" for m, us in summary["imports_self_us"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
