"""grpo-sdk, TRL's GRPOTrainer and a bare hand-written GRPO loop over model sizes and lengths.

Per (size, length) cell: step time, generated tokens/s and peak RSS of each contender, and the
ratios grpo-sdk/TRL and grpo-sdk/bare. CPU, one torch thread everywhere.

Models: random-init Llamas built locally (``--sizes``: 0.1M to 25M parameters, the shapes in
``SIZES``) with a locally trained ByteLevel BPE tokenizer (vocab 384); no hub.

Workload: ``--prompts`` x ``--generations`` rows per step (default 8 x 4), up to ``--lengths`` new
tokens, temperature 1, no top-k/top-p, no KL, one AdamW step per GRPO step, reward = share of
vowels (varies between samples, does not depend on the length). **Long-tailed lengths, the same
for every contender**: the model itself emits EOS with probability 1/``--eos-mean`` at every
decode step whatever came before (one constant residual dimension read only by the EOS row of the
LM head, calibrated when the model is built: ``_common.set_eos_probability``), so lengths are
geometric (mean ``--eos-mean``, p90 ~2.3x that, capped at the cell's length). All three sample
from the same weights' full softmax, so they sample the same length distribution; the learning
rate (1e-6 by default) keeps 20 steps from moving it, and the step's work does not depend on the
rate. The measured mean/median/p90 response length is printed per contender to show it.

**Fixed lengths** (the default since issue 35 item 6): sampling the same law still lets one contender
draw the long row and another not, and a long-tailed cell's ratio then moved by 0.26 between reruns.
So the lengths of every step's rows are drawn once from ``--seed`` (the same geometric law, capped)
and every contender decodes exactly those: grpo-sdk through per-row budgets with EOS ignored
(``GenerationInput.max_new_tokens``, ``SamplingParams.ignore_eos``), TRL through a logits processor on
its model's ``generate`` that forbids EOS before a row's length and forces it there (TRL has no per-row
length option), the bare loop by decoding the step's longest length and placing each row's EOS. Each
row still ends in EOS, as a sampled one does. ``--sampled-lengths`` restores the old behaviour. The
per-round grpo-sdk/TRL ratio (median, range, spread) says how much a rerun would move it.

Contenders (each one's fastest set-up a user would choose):

* ``grpo-sdk``: ``GRPOTrainer.train_step()`` on an hf policy and hf generation, plus every
  ``--grpo-override key=value`` (e.g. ``policy.sequence_packing.enabled=true``);
* ``trl``: TRL's ``GRPOTrainer`` with HF ``generate`` rollouts (``use_vllm=False``), gradient
  checkpointing off (faster on CPU than TRL's default on), each step timed by a ``TrainerCallback``;
* ``bare``: a hand-written step on one model (KV-cache sampling that stops when every row has
  sampled EOS, reward, group-normalise, one padded forward/backward, AdamW).

Design: every contender runs in **its own subprocess** (this script with ``--worker``), so its peak
RSS (``ru_maxrss``: imports, model, optimizer state, activations) is its own. The parent starts the
three workers of a cell, waits until each has built its trainer, then **alternates steps**: one
step of one worker at a time, the order rotating every round, so all three see the same machine
load and none runs while another computes. TRL's own loop runs in its worker and blocks in
``on_step_end`` until the parent asks for the next step (outside the timed window). Step time is
the median after ``--warmup`` steps; tokens/s is the generated tokens (EOS included) of the timed
steps over their summed time.

Run from the repo root (bench venv: TRL installed)::

    OMP_NUM_THREADS=1 .venv-bench/bin/python benchmarks/scale.py --sizes 0.1M,1.6M,25M --lengths 32,256
    OMP_NUM_THREADS=1 .venv-bench/bin/python benchmarks/scale.py --quick    # a smoke run, ~1-2 min

Without TRL installed, ``--contenders grpo-sdk,bare`` runs the rest. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _workers import read_event

CONTENDERS = ("grpo-sdk", "trl", "bare")
# name -> (hidden, layers, intermediate, heads): Llama shapes, ~12 x hidden^2 parameters per layer
SIZES = {
    "0.1M": (64, 2, 176, 2),
    "0.4M": (128, 2, 256, 2),  # trl_side_by_side.py's anchor shape
    "1.6M": (176, 4, 464, 2),
    "6M": (256, 7, 688, 4),
    "12.6M": (384, 7, 1024, 6),
    "25M": (512, 8, 1360, 8),
}
PREFIX = "@@scale "  # marks the worker's protocol lines among whatever the libraries print


# --- the worker: one contender in its own process ----------------------------------------------------


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process, MiB."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def say(**message) -> None:
    print(PREFIX + json.dumps(message), flush=True)


def wait_for_command() -> str:
    return sys.stdin.readline().strip()


def worker(args: argparse.Namespace) -> None:
    import _common  # one torch thread, offline hub
    import torch

    torch.set_num_threads(1)
    model_dir, work = Path(args.model_dir), Path(tempfile.mkdtemp(prefix=f"scale-{args.worker}-"))
    shape = dict(prompts=args.prompts, generations=args.generations, new_tokens=args.new_tokens, lr=args.lr)
    total = args.warmup + args.steps
    table = None if args.sampled_lengths else _common.fixed_lengths(
        args.seed, args.eos_mean, args.new_tokens, total, args.prompts * args.generations)
    if args.worker == "grpo-sdk":
        trainer = _common.build_sdk(model_dir, work, name="sdk", steps=total, environment="vowels",
                                    overrides=args.grpo_override, **shape)
        if table is not None:
            _common.force_sdk_lengths(trainer, table, trainer.components.generation.eos_token_id)
        say(event="ready", rss=rss_mb())
        while wait_for_command() == "step":
            result = _common.sdk_step(trainer)
            say(event="step", wall=result["wall"], lengths=result["lengths"],
                phases={k[len("timing/"):]: v for k, v in result.items()
                        if k.startswith("timing/") and k.count("/") == 1 and isinstance(v, float)})
    elif args.worker == "bare":
        bare = _common.BareGRPO(model_dir, reward=_common.vowel_reward, stop_at_eos=True, lengths=table, **shape)
        say(event="ready", rss=rss_mb())
        while wait_for_command() == "step":
            wall = bare.step()
            say(event="step", wall=wall, lengths=bare.lengths)
    else:
        run_trl_worker(model_dir, work, shape, total, table)
    say(event="done", rss=rss_mb())


def run_trl_worker(model_dir: Path, work: Path, shape: dict, total: int, table: list | None) -> None:
    import _common
    from transformers import TrainerCallback

    class Lengths:
        last: list[int] = []

    def reward(text: str) -> float:
        return _common.vowel_reward(text)

    class Stepper(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            wall = time.perf_counter() - self.start
            say(event="step", wall=wall, lengths=Lengths.last)
            if wait_for_command() != "step":  # outside the timed window
                control.should_training_stop = True

    trainer = _common.build_trl(model_dir, work, steps=total, reward=reward, gradient_checkpointing=False,
                                callbacks=[Stepper()], **shape)
    if table is not None:
        _common.force_trl_lengths(trainer, table, trainer.processing_class.eos_token_id)
    original = trainer._calculate_rewards

    def calculate_rewards(inputs, prompts, completions, completion_ids_list):  # the step's response lengths
        Lengths.last = [len(ids) for ids in completion_ids_list]
        return original(inputs, prompts, completions, completion_ids_list)

    trainer._calculate_rewards = calculate_rewards
    say(event="ready", rss=rss_mb())
    if wait_for_command() == "step":
        trainer.train()


# --- the parent: builds the models, alternates the workers --------------------------------------------


class Worker:
    def __init__(self, name: str, model_dir: Path, new_tokens: int, args: argparse.Namespace, log: Path):
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model-dir", str(model_dir),
                "--new-tokens", str(new_tokens), "--prompts", str(args.prompts), "--generations",
                str(args.generations), "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
                "--eos-mean", str(args.eos_mean), "--seed", str(args.seed)] + ["--sampled-lengths"] * args.sampled_lengths
        for override in args.grpo_override:
            argv += ["--grpo-override", override]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONWARNINGS": "ignore"}
        self.name, self.log = name, log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True, env=env, cwd=Path(__file__).resolve().parent)
        self.steps: list[dict] = []

    def read(self, event: str) -> dict:
        return read_event(self, PREFIX, event)

    def command(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()


def run_cell(size: str, model_dir: Path, new_tokens: int, args: argparse.Namespace, logs: Path) -> dict:
    import _common

    workers = [Worker(name, model_dir, new_tokens, args, logs / f"{size}-{new_tokens}-{name}.log")
               for name in args.contenders]
    try:
        ready = {w.name: w.read("ready") for w in workers}  # set-up may overlap; nothing is timed yet
        for round_ in range(args.warmup + args.steps):
            shift = round_ % len(workers)
            for w in workers[shift:] + workers[:shift]:
                w.command("step")
                w.steps.append(w.read("step"))
        results = {}
        table = None if args.sampled_lengths else _common.fixed_lengths(
            args.seed, args.eos_mean, new_tokens, args.warmup + args.steps, args.prompts * args.generations)
        for w in workers:
            w.command("stop")
            done = w.read("done")
            w.proc.wait(timeout=120)
            timed = w.steps[args.warmup:]
            walls = [s["wall"] for s in timed]
            lengths = [n for s in timed for n in s["lengths"]]
            results[w.name] = {"step_s": statistics.median(walls),
                               "tokens_per_s": sum(lengths) / sum(walls), "rss_ready_mb": ready[w.name]["rss"][0],
                               "peak_rss_mb": done["rss"][1], "lengths": _common.length_stats(lengths),
                               "step_times": [round(s["wall"], 4) for s in w.steps]}
            if table is not None:  # each step decoded the drawn lengths (rows in any order)
                results[w.name]["lengths_match"] = all(sorted(s["lengths"]) == sorted(row)
                                                       for s, row in zip(w.steps, table))
            if timed and "phases" in timed[0]:  # grpo-sdk: where its step goes (what dominates at this size)
                results[w.name]["phases_s"] = {k: round(statistics.median(s["phases"].get(k, 0.0) for s in timed), 4)
                                               for k in timed[0]["phases"]}
        return results
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0.1M,1.6M,25M", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--lengths", default="32,128,256", help="max new tokens per cell, comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contender and cell")
    parser.add_argument("--warmup", type=int, default=2, help="steps per contender dropped first")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="generations per prompt")
    parser.add_argument("--eos-mean", type=float, default=48.0,
                        help="mean response length before the cap: EOS probability 1/this at every decode step")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate (small: keeps the lengths put)")
    parser.add_argument("--seed", type=int, default=0, help="draws the fixed lengths")
    parser.add_argument("--sampled-lengths", action="store_true",
                        help="each contender samples its own lengths (before issue 35: a ratio then depends on "
                        "who drew the long rows); default: every contender decodes the same drawn lengths")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, of " +
                        ", ".join(CONTENDERS))
    parser.add_argument("--grpo-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a grpo-sdk config override (repeatable), e.g. policy.sequence_packing.enabled=true")
    parser.add_argument("--quick", action="store_true", help="smoke run: 0.1M, lengths 16,64, 2 steps + 1 warm-up")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.quick:
        args.sizes, args.lengths, args.steps, args.warmup = "0.1M", "16,64", 2, 1
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if unknown := [s for s in args.sizes if s not in SIZES]:
        parser.error(f"--sizes: unknown {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    if unknown := [c for c in args.contenders if c not in CONTENDERS]:
        parser.error(f"--contenders: unknown {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    if not args.contenders or min(args.lengths) < 1 or args.steps < 1 or args.warmup < 0 or args.eos_mean <= 1:
        parser.error("need a contender, lengths >= 1, --steps >= 1, --warmup >= 0 and --eos-mean > 1")
    if bad := [o for o in args.grpo_override if "=" not in o]:
        parser.error(f"--grpo-override takes KEY=VALUE, got {bad[0]!r}")
    if "trl" in args.contenders:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            parser.error("TRL is not installed in this interpreter: use the bench venv (docs/benchmarks.md), "
                         "or --contenders grpo-sdk,bare")
    return args


def ratio(results: dict, a: str, b: str, key: str) -> float | None:
    return results[a][key] / results[b][key] if a in results and b in results else None


def paired_ratio(results: dict, a: str, b: str, warmup: int) -> dict | None:
    """a/b step time per round (the two steps of one round saw the same load): median, range, spread."""
    if a not in results or b not in results:
        return None
    paired = [x / y for x, y in zip(results[a]["step_times"][warmup:], results[b]["step_times"][warmup:])]
    return {"median": statistics.median(paired), "min": min(paired), "max": max(paired),
            "spread": max(paired) - min(paired)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    load_before = os.getloadavg()[0]
    try:
        cells = run_cells(args)
    except RuntimeError as exc:  # a worker failed: its log's tail says why (a bad --grpo-override, say)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
               "load_avg_before": round(load_before, 2), "load_avg_after": round(os.getloadavg()[0], 2),
               "prompts": args.prompts, "generations": args.generations, "steps": args.steps, "warmup": args.warmup,
               "eos_mean": args.eos_mean, "lr": args.lr, "fixed_lengths": not args.sampled_lengths, "seed": args.seed, "grpo_overrides": args.grpo_override, "cells": cells}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"\ntorch {summary['torch']}, {summary['cpus']} CPUs, one thread per contender; load avg "
              f"{summary['load_avg_before']:.2f} -> {summary['load_avg_after']:.2f}; grpo-sdk overrides: "
              f"{' '.join(args.grpo_override) or 'none'}")
    return 0


def run_cells(args: argparse.Namespace) -> list[dict]:
    import _common

    cells = []
    with tempfile.TemporaryDirectory(prefix="grpo-scale-") as tmp:
        for size in args.sizes:
            hidden, layers, intermediate, heads = SIZES[size]
            model_dir = Path(tmp) / f"model-{size}"
            params = _common.build_model(model_dir, hidden=hidden, layers=layers, intermediate=intermediate,
                                         heads=heads, eos_probability=1 / args.eos_mean)
            for new_tokens in args.lengths:
                started = time.perf_counter()
                results = run_cell(size, model_dir, new_tokens, args, Path(tmp))
                cells.append({"size": size, "parameters": params, "new_tokens": new_tokens, "results": results,
                              "wall_s": round(time.perf_counter() - started, 1),
                              "grpo_over_trl_step": ratio(results, "grpo-sdk", "trl", "step_s"),
                              "grpo_over_bare_step": ratio(results, "grpo-sdk", "bare", "step_s"),
                              "grpo_over_trl_peak_rss": ratio(results, "grpo-sdk", "trl", "peak_rss_mb"),
                              "grpo_over_trl_paired": paired_ratio(results, "grpo-sdk", "trl", args.warmup)})
                if not args.json:
                    print_cell(cells[-1], args)
    return cells


def print_cell(cell: dict, args: argparse.Namespace) -> None:
    print(f"\n[{cell['size']} ({cell['parameters'] / 1e6:.2f}M parameters), up to {cell['new_tokens']} new tokens, "
          f"{args.prompts}x{args.generations} rows, median of {args.steps} steps after {args.warmup}; "
          f"cell wall {cell['wall_s']} s]")
    print(f"{'contender':<10} {'s/step':>8} {'tok/s':>9} {'RSS ready MB':>13} {'peak RSS MB':>12}   "
          f"response length mean / median / p90 / max")
    for name, r in cell["results"].items():
        n = r["lengths"]
        print(f"{name:<10} {r['step_s']:>8.4f} {r['tokens_per_s']:>9,.0f} {r['rss_ready_mb']:>13.0f} "
              f"{r['peak_rss_mb']:>12.0f}   {n['mean']:.1f} / {n['median']:.1f} / {n['p90']} / {n['max']}")
    parts = [f"{label} {value:.3f}" for label, value in (("grpo-sdk/TRL step", cell["grpo_over_trl_step"]),
                                                         ("grpo-sdk/bare step", cell["grpo_over_bare_step"]),
                                                         ("grpo-sdk/TRL peak RSS", cell["grpo_over_trl_peak_rss"]))
             if value is not None]
    print("ratios: " + ", ".join(parts))
    if paired := cell["grpo_over_trl_paired"]:
        print(f"grpo-sdk/TRL step, per round: median {paired['median']:.3f}, range {paired['min']:.3f}-"
              f"{paired['max']:.3f} (spread {paired['spread']:.3f})")
    phases = cell["results"].get("grpo-sdk", {}).get("phases_s")
    if phases:
        total = phases.pop("step", None) or sum(phases.values()) or 1.0
        print("grpo-sdk phases (median s, share of its step): " + ", ".join(
            f"{k} {v:.3f} ({v / total:.0%})" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if v >= 0.001))


if __name__ == "__main__":
    sys.exit(main())
