"""Async GRPO against the synchronous loop: samples/s, time to a reward threshold, reward per sample.

The same config trains once synchronously and once with ``grpo.async_grpo.enabled=true``
(deterministic schedule, importance-sampling correction on, ``max_trajectory_age_steps`` A); the
two differ in those keys only. Contenders alternate within one process, round by round (sync,
async A=1, [async A=2], sync, ...), each in a fresh run directory, so all see the same load on a
shared machine; round r uses ``grpo.seed = 42 + r`` for every contender, so the spread across
rounds is the seed noise the reward comparison is judged against.

Scenarios (``--scenarios``):

* ``a``: the built-in recipe (``grpoctl run``'s defaults: 2-layer GPT-2 d64, 8 x 16 rows, 5 new tokens),
  validation and checkpoints off;
* ``b``: the same task behind a judge that sleeps 0.2 s per scoring call
  (benchmarks/async_envs.py ``slow_reverse_digits``), on a 4-layer d256 GPT-2 (3.2M parameters)
  so that training (~0.4 s) is about generation + scoring (~0.35 s): where overlap gains most;
* ``c``: long-tailed response lengths (``longtail_reverse``: digit strings of Pareto length, shape
  1.2 from 2 to 40 digits, answered with a stop token, ``max_new_tokens=48``), on the built-in
  model's shape with 128 positions; training ~0.2 s against generation ~0.2 s;
* ``c4`` (not in the default run): scenario c on a 4-layer d128 GPT-2 (0.8M parameters), where
  the model's kernels (which release the GIL) outweigh the Python around them;
* ``br`` and ``cr`` (not in the default run): b and c on ``longtail_repeat`` (repeat one digit, 5
  times for br, Pareto lengths for cr), a task these models learn within 150 steps, for the
  reward per sample that b's and c's reversal cannot show in a feasible budget;
* ``d``: scenario b on Ray (``cluster.runtime=ray``, ``policy.generation.colocated.enabled=false``:
  one policy worker, one generation worker, one environment actor; async: the collector actor);
* ``e`` (not in the default run): scenario c, sync and async in-process against async on Ray,
  where the collector and generation run in processes of their own (no shared GIL with training):
  the thread-or-process question of design/async-grpo.md §3.6, measured.

Measured per run: samples/s = rows trained per wall second of the training loop, from the end of
step ``--skip`` to the end of the last step (the ``on_step`` callback's clock: everything between
steps counts; set-up and the pipeline's first fill do not); the sum of ``timing/step`` from
metrics.jsonl is printed next to it as a cross-check. Time (and samples) to the threshold: from the
end of set-up to the first step whose trailing 10-step mean of ``reward/mean`` reaches it. Reward
per sample: the mean ``reward/mean`` of the last 10 steps (every contender trains the same rows per
step and the same number of steps), and the reward curve: that trailing mean after 25/50/75/100% of
the run's samples, per round, with each async contender's difference from sync and the standard
error of that difference from the spread across rounds (seeds).

Run from the repo root (about 8 minutes with the defaults on 2 cores)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/async_vs_sync.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/async_vs_sync.py --scenarios b c --rounds 3 --steps 150

Results: docs/benchmarks.md ("Async vs sync").
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # must precede `import torch`
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import attrs
import torch

torch.set_num_threads(1)

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # async_envs is loaded as a hook plugin module (-p), as Ray workers load it
    sys.path.insert(0, str(HERE))

PLUGINS = ["async_envs"]
SEED = 42  # round r (from 0) uses grpo.seed and the model's init seed SEED + r
WINDOW = 10  # steps in the trailing reward mean (threshold, curve) and in the final reward
CURVE_AT = (0.25, 0.5, 0.75, 1.0)  # fractions of the run's samples where the reward curve is printed
BASE = ["grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false", "logger.loggers=[jsonl]",
        "cluster.num_threads=1"]
RAY = ["cluster.runtime=ray", "policy.generation.colocated.enabled=false"]
CONTENDERS = {
    "sync": [],
    "async A=1": ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                  "grpo.async_grpo.max_trajectory_age_steps=1"],
    "async A=2": ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                  "grpo.async_grpo.max_trajectory_age_steps=2"],
}
CONTENDERS["async A=1 Ray"] = CONTENDERS["async A=1"] + RAY  # the collector and generation in processes
LATENCY = ["env.name=slow_reverse_digits", "env.slow_reverse_digits.latency_s=0.2"]
LONG_ANSWERS = ["policy.generation.max_new_tokens=48", "policy.max_total_sequence_length=96"]
LONG_TAIL = ["env.name=longtail_reverse", *LONG_ANSWERS]
LONG_TAIL_REPEAT = ["env.name=longtail_repeat", *LONG_ANSWERS]


@attrs.frozen
class Scenario:
    title: str
    overrides: list[str]
    steps: int
    threshold: float
    contenders: tuple[str, ...]
    model: dict[str, int] | None = None  # build_tiny_gpt2 shape; None: the recipe's builtin:tiny-gpt2
    ray: bool = False


SCENARIOS = {
    "a": Scenario("(a) built-in recipe", [], 500, 0.9, ("sync", "async A=1", "async A=2")),
    "b": Scenario("(b) 0.2 s per scoring call", LATENCY, 60, 0.2, ("sync", "async A=1", "async A=2"),
                  model={"n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 64}),
    "c": Scenario("(c) long-tailed response lengths", LONG_TAIL, 60, 0.1, ("sync", "async A=1"),
                  model={"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "br": Scenario("(br) = (b) with a task the model learns (repeat a digit 5 times)",
                   ["env.name=longtail_repeat", "env.longtail_repeat.min_digits=5", "env.longtail_repeat.max_digits=5",
                    "env.longtail_repeat.latency_s=0.2"], 150, 0.5, ("sync", "async A=1", "async A=2"),
                   model={"n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 64}),
    "cr": Scenario("(cr) = (c) with a task the model learns (repeat a digit)", LONG_TAIL_REPEAT, 100, 0.5,
                   ("sync", "async A=1"), model={"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "c4": Scenario("(c4) = (c) on a 4-layer d128 GPT-2", LONG_TAIL, 30, 0.1, ("sync", "async A=1"),
                   model={"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 128}),
    "d": Scenario("(d) = (b) on Ray, separate generation and policy workers", LATENCY + RAY, 30, 0.2,
                  ("sync", "async A=1"), model={"n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 64},
                  ray=True),
    "e": Scenario("(e) = (c), async in-process against async on Ray", LONG_TAIL, 60, 0.1,
                  ("sync", "async A=1", "async A=1 Ray"),
                  model={"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}, ray=True),
}


@attrs.define
class Run:
    contender: str
    round: int
    rows: int
    setup_done: float = 0.0
    times: list[float] = attrs.Factory(list)  # perf_counter at the end of each step
    metrics: list[dict[str, float]] = attrs.Factory(list)

    def samples_per_s(self, skip: int) -> float:
        skip = min(skip, len(self.times) - 2)
        return self.rows * (len(self.times) - 1 - skip) / (self.times[-1] - self.times[skip])

    def timed_samples_per_s(self, skip: int) -> float:
        steps = self.metrics[min(skip, len(self.metrics) - 2) + 1:]
        return self.rows * len(steps) / sum(m["timing/step"] for m in steps)

    def to_threshold(self, threshold: float) -> tuple[int, float] | None:
        rewards = [m["reward/mean"] for m in self.metrics]
        for i in range(len(rewards)):
            if statistics.mean(rewards[max(0, i + 1 - WINDOW):i + 1]) >= threshold:
                return i + 1, self.times[i] - self.setup_done
        return None

    def final_reward(self) -> float:
        return self.trailing_reward(len(self.metrics))

    def trailing_reward(self, steps: int) -> float:
        """Mean ``reward/mean`` of the WINDOW steps ending at step ``steps`` (fewer at the start)."""
        return statistics.mean(m["reward/mean"] for m in self.metrics[max(0, steps - WINDOW):steps])

    def median(self, key: str) -> float | None:
        values = [m[key] for m in self.metrics[1:] if key in m]
        return statistics.median(values) if values else None


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load avg {one:.2f} (5 min {five:.2f})"


def train(scenario: Scenario, contender: str, round_: int, steps: int, work: Path, model_dir: Path | None) -> Run:
    import grpo_sdk
    from grpo_sdk.trainer.launch import open_run, run_trainer

    overrides = [*BASE, f"grpo.max_num_steps={steps}", f"grpo.seed={SEED + round_}", *scenario.overrides,
                 *CONTENDERS[contender]]
    if model_dir is not None:
        overrides.append(f"policy.model_name={model_dir}")
    run_dir = work / f"r{round_}-{contender.replace(' ', '').replace('=', '')}"
    api = grpo_sdk.Trainer(None, run_dir=run_dir, overrides=overrides, plugins=PLUGINS)
    grpo = api.config.grpo
    run = Run(contender, round_, grpo.num_prompts_per_step * grpo.num_generations_per_prompt)

    def on_setup(trainer) -> None:
        run.setup_done = time.perf_counter()

    def on_step(step: int, metrics: dict[str, float]) -> None:
        run.times.append(time.perf_counter())
        run.metrics.append(dict(metrics))

    run_trainer(api.config, open_run(api.config, run_dir, resume=False), api.registry, on_setup=on_setup,
                on_step=on_step)
    if len(run.times) != steps:
        raise RuntimeError(f"{contender} round {round_} trained {len(run.times)} of {steps} steps")
    return run


def build_model(scenario: Scenario, round_: int, work: Path) -> Path | None:
    if scenario.model is None:
        return None
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    return build_tiny_gpt2(work / f"model-r{round_}", SEED + round_, **scenario.model)


def start_ray() -> None:
    """One local cluster for every Ray run (the runtime uses a cluster that is already up)."""
    import ray

    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, object_store_memory=512 << 20, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path,
                                       "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}})


def run_scenario(key: str, scenario: Scenario, args: argparse.Namespace, work: Path) -> list[Run]:
    steps = args.steps or scenario.steps
    scenario = attrs.evolve(scenario, overrides=[*scenario.overrides, *args.set],
                            threshold=scenario.threshold if args.threshold is None else args.threshold)
    contenders = [c for c in scenario.contenders if args.contenders is None or c in args.contenders]
    print(f"\n{scenario.title}: {steps} steps, {args.rounds} round(s), contenders {', '.join(contenders)}; "
          f"{load()}", flush=True)
    runs = []
    for round_ in range(args.seed - SEED, args.seed - SEED + args.rounds):
        model_dir = build_model(scenario, round_, work / key)
        for contender in contenders:
            start = time.perf_counter()
            run = train(scenario, contender, round_, steps, work / key, model_dir)
            runs.append(run)
            print(f"  round {round_ + 1} {contender:<13} {time.perf_counter() - start:6.1f} s, "
                  f"{run.samples_per_s(args.skip):7.1f} samples/s, final reward {run.final_reward():.3f}; {load()}",
                  flush=True)
    report(scenario, runs, contenders, args.skip)
    return runs


def report(scenario: Scenario, runs: list[Run], contenders: list[str], skip: int) -> None:
    by = {c: [r for r in runs if r.contender == c] for c in contenders}
    base = statistics.mean(r.samples_per_s(skip) for r in by["sync"]) if by.get("sync") else None
    thr = scenario.threshold
    print(f"\n{scenario.title}: rows {runs[0].rows}/step, {len(runs[0].times)} steps; per-round values "
          f"in brackets; reward = mean reward/mean of the last {WINDOW} steps; threshold {thr} "
          f"(trailing {WINDOW}-step mean); {load()}")
    header = (f"{'contender':<13} {'samples/s':>9} {'x sync':>7} {'(rounds)':<20} {'timed':>7} {'s/step':>7} "
              f"{'train':>6} {'gen+score':>9} {'wait':>6} {'bubble':>6} {'steps to':>8} {'s to':>6} "
              f"{'reward':>6} {'(rounds)':<16}")
    print(header)
    print("-" * len(header))
    for contender, rs in by.items():
        if not rs:
            continue
        sps = [r.samples_per_s(skip) for r in rs]
        ratio = f"{statistics.mean(sps) / base:7.2f}" if base else f"{'':>7}"
        hits = [r.to_threshold(thr) for r in rs]
        steps_to = "/".join(str(h[0]) if h else "-" for h in hits)
        time_to = "/".join(f"{h[1]:.0f}" if h else "-" for h in hits)
        gen = "timing/rollout" if contender == "sync" else "timing/collector/generation"
        wait = "timing/rollout" if contender == "sync" else "timing/exposed_generation"

        def ms(key: str, rs: list[Run] = rs) -> str:
            values = [v for r in rs if (v := r.median(key)) is not None]
            return f"{statistics.mean(values):.3f}" if values else "-"

        rewards = [r.final_reward() for r in rs]
        print(f"{contender:<13} {statistics.mean(sps):9.1f} {ratio} {'(' + ' '.join(f'{s:.1f}' for s in sps) + ')':<20} "
              f"{statistics.mean(r.timed_samples_per_s(skip) for r in rs):7.1f} "
              f"{runs[0].rows / statistics.mean(sps):7.3f} {ms('timing/train'):>6} {ms(gen):>9} {ms(wait):>6} "
              f"{ms('timing/refit_bubble'):>6} {steps_to:>8} {time_to:>6} {statistics.mean(rewards):6.3f} "
              f"{'(' + ' '.join(f'{x:.3f}' for x in rewards) + ')':<16}")
    lengths = [r.median("env/length_max") for r in runs]
    if all(v is not None for v in lengths):
        p50 = statistics.mean(r.median("env/length_p50") for r in runs)
        p90 = statistics.mean(r.median("env/length_p90") for r in runs)
        print(f"response lengths per step (tokens, stop included), median over steps: p50 {p50:.1f}, "
              f"p90 {p90:.1f}, max {statistics.mean(lengths):.1f} (max_new_tokens caps the tail)")
    sync_rewards = [r.final_reward() for r in by.get("sync", [])]
    for contender, rs in by.items():
        if contender == "sync" or not rs or not sync_rewards:
            continue
        diff = statistics.mean(r.final_reward() for r in rs) - statistics.mean(sync_rewards)
        spread = max(sync_rewards) - min(sync_rewards) if len(sync_rewards) > 1 else float("nan")
        print(f"{contender}: samples/s x{statistics.mean(r.samples_per_s(skip) for r in rs) / base:.2f} of sync; "
              f"final reward {diff:+.3f} against sync (sync's spread across seeds {spread:.3f})")
    report_curve(by)


def checkpoints(steps: int) -> list[int]:
    """The steps at CURVE_AT of the run's samples (every contender trains the same rows per step)."""
    return sorted({max(1, round(q * steps)) for q in CURVE_AT})


def difference(runs: list[Run], sync: list[Run], steps: int) -> tuple[float, float]:
    """Mean trailing reward of ``runs`` minus sync's at ``steps``, and the standard error of that
    difference from the spread across rounds (seeds); NaN with one round, where there is no spread."""
    a, s = [r.trailing_reward(steps) for r in runs], [r.trailing_reward(steps) for r in sync]
    if len(a) < 2 or len(s) < 2:
        return statistics.mean(a) - statistics.mean(s), float("nan")
    return (statistics.mean(a) - statistics.mean(s),
            (statistics.variance(a) / len(a) + statistics.variance(s) / len(s)) ** 0.5)


def report_curve(by: dict[str, list[Run]]) -> None:
    """The reward curve per sample: trailing rewards at a few sample counts, so a reader sees whether
    the contenders' curves overlap, not only where they end. Within noise: |difference| <= 2 standard
    errors, the normal 95% (with 2-3 seeds a t-test would allow more, so this calls a gap sooner); it
    means "no evidence of a gap", not "equal"."""
    first = next(rs[0] for rs in by.values() if rs)
    steps = checkpoints(len(first.metrics))
    heads = [f"{first.rows * s} rows ({s} steps)" for s in steps]
    width = max(26, *(len(h) for h in heads))
    print(f"\nreward per sample: trailing {WINDOW}-step mean of reward/mean after "
          f"{'/'.join(f'{q:.0%}' for q in CURVE_AT)} of the samples, rounds in brackets")
    print(f"{'contender':<13} " + " ".join(h.rjust(width) for h in heads))
    for contender, rs in by.items():
        if not rs:
            continue
        cells = []
        for s in steps:
            values = [r.trailing_reward(s) for r in rs]
            cells.append(f"{statistics.mean(values):.3f} ({' '.join(f'{v:.3f}' for v in values)})".rjust(width))
        print(f"{contender:<13} " + " ".join(cells))
    for contender, rs in by.items():
        if contender == "sync" or not rs or not by.get("sync"):
            continue
        diffs = [difference(rs, by["sync"], s) for s in steps]
        if any(math.isnan(se) for _, se in diffs):
            verdict = "one round: no seed spread to judge noise by"
        else:
            verdict = f"within noise (|diff| <= 2 SE) at {sum(abs(d) <= 2 * se for d, se in diffs)} of {len(steps)}"
        print(f"{contender} - sync: " + ", ".join(f"{d:+.3f} +/- {se:.3f}" for d, se in diffs)
              + f" (diff +/- SE); {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", nargs="*", default=["a", "b", "c", "d"], choices=list(SCENARIOS),
                        help="c4 (not run by default, ~4 min a round): the long tails where kernels outweigh Python")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of alternated contenders per scenario")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the scenario's)")
    parser.add_argument("--contenders", nargs="*", default=None, choices=list(CONTENDERS),
                        help="contenders to run (default: the scenario's); sync is the baseline")
    parser.add_argument("--seed", type=int, default=SEED, help="the first round's seed (more seeds in a later run)")
    parser.add_argument("--threshold", type=float, default=None, help="reward threshold (default: the scenario's)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides added to the scenario's, for every contender")
    parser.add_argument("--skip", type=int, default=2, help="steps left out of samples/s (warm-up, pipeline fill)")
    args = parser.parse_args()
    if args.contenders is not None and "sync" not in args.contenders:
        parser.error("--contenders must include sync (the baseline of every ratio)")
    if args.seed < SEED:
        parser.error(f"--seed must be at least {SEED} (round r uses seed {SEED} + r)")
    if args.steps is not None and args.steps < 3:
        parser.error("--steps must be at least 3")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_NUM_THREADS="
          f"{os.environ['OMP_NUM_THREADS']}, cpus {os.cpu_count()}, {load()}", flush=True)
    ray_started = False
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-async-bench-") as tmp:
            for key in args.scenarios:
                scenario = SCENARIOS[key]
                if scenario.ray and not ray_started:
                    start_ray()
                    ray_started = True
                run_scenario(key, scenario, args, Path(tmp))
    finally:
        if ray_started:
            import ray

            ray.shutdown()


if __name__ == "__main__":
    main()
