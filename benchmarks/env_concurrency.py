"""Step time with a 0.2 s-per-call environment: one call per turn against concurrent calls per group.

Scenario (b) of benchmarks/async_vs_sync.py (``slow_reverse_digits``: every scoring call sleeps
0.2 s, on a 4-layer d256 GPT-2, 8 prompts x 16 samples), trained sync and async (A=1), each with
``env.max_concurrent_calls=0`` (one call for the whole turn: the rollout before streaming) and with
``env.max_concurrent_calls=N`` (a call per group, N at a time). The four contenders alternate
within one process, round by round (the order reversed every other round), so all see the same
load; printed per contender: the median
``timing/step`` after ``--skip`` steps and samples per wall second.

What it can show: whether scoring stops being the step's floor. With a judge whose latency is per
call, the last group's call starts after the last row is decoded whatever the bound, so a
single-turn step should not move; ``--scenario c`` (long-tailed lengths) lets groups finish apart.

    OMP_NUM_THREADS=1 taskset -c 1 nice .venv/bin/python benchmarks/env_concurrency.py --steps 12 --rounds 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import async_vs_sync as avs  # sets the thread and offline environment first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the timing (warm-up)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--calls", type=int, default=8, help="env.max_concurrent_calls of the 'after' contenders")
    parser.add_argument("--scenario", choices=("b", "c"), default="b",
                        help="b: equal lengths; c: long-tailed lengths (longtail_reverse), its judge made 0.2 s a call")
    args = parser.parse_args()
    scenario = avs.SCENARIOS[args.scenario]
    if args.scenario == "c":
        scenario = avs.attrs.evolve(scenario, title=scenario.title + ", 0.2 s per scoring call",
                                    overrides=[*scenario.overrides, "env.longtail_reverse.latency_s=0.2"])
    contenders = {f"{mode} calls={calls}": (mode, [f"env.max_concurrent_calls={calls}"])
                  for calls in (0, args.calls) for mode in ("sync", "async A=1")}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    print(f"{scenario.title}, {args.steps} steps, {avs.load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for round_ in range(args.rounds):
            model_dir = avs.build_model(scenario, round_, work)
            order = list(contenders.items())  # reversed every other round: no contender always goes first
            for name, (mode, extra) in order if round_ % 2 == 0 else order[::-1]:
                key = f"{mode} +{extra[0]}"
                avs.CONTENDERS[key] = avs.CONTENDERS[mode] + extra
                started = time.perf_counter()
                run = avs.train(scenario, key, round_, args.steps, work, model_dir)
                steps = [m["timing/step"] for m in run.metrics[args.skip:]]
                times[name].append(statistics.median(steps))
                rates[name].append(run.samples_per_s(args.skip))
                print(f"  round {round_} {name:>20}: step {times[name][-1]:.3f} s (median), "
                      f"{rates[name][-1]:.1f} samples/s, {time.perf_counter() - started:.0f} s, {avs.load()}",
                      flush=True)
    print("contender              step s (median of rounds)  samples/s")
    for name in contenders:
        print(f"{name:>20}   {statistics.median(times[name]):.3f}                    "
              f"{statistics.median(rates[name]):.1f}")


if __name__ == "__main__":
    main()
