"""Held-out greedy accuracy of trained runs and models, all scored by one evaluator.

A run's own validation samples with its policy's settings (the recipe's: bfloat16 autocast), so two
runs' curves differ a little by arithmetic as well as by training. This script scores every model it
is given the same way, with the evaluator of ``benchmarks/real_model.py`` (greedy, float32,
transformers ``generate``, the recipe's validation rows, template and math scoring): the base model
and each run's final policy, so "before" and "after" are measured alike.

Each argument is a model directory (config, safetensors, tokenizer) or a ``grpoctl run`` directory,
whose latest checkpoint is exported first (``grpoctl export``, into a temporary directory)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/heldout.py --base DIR runs/seed1 runs/seed2 runs/seed3

prints one line per model and, with two or more runs, the mean gain over the base and its standard
error (``--json`` prints one object).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common  # noqa: F401 - one torch thread and the offline hub, before torch is imported
from real_model import RECIPE, eval_options, evaluate, without_quantization_config

from grpo_sdk.config.loading import load_config
from grpo_sdk.plugins.registry import Registry


def model_dir(path: Path, tmp: Path) -> Path:
    """``path`` if it is a model directory, else the export of the run directory's latest checkpoint."""
    if (path / "config.json").is_file():
        return without_quantization_config(path, tmp)[0]
    out = tmp / path.name
    grpoctl = Path(sys.executable).with_name("grpoctl")
    done = subprocess.run([str(grpoctl), "export", str(path), str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: grpoctl export {path} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="grpoctl run directories or model directories")
    parser.add_argument("--base", type=Path, required=True, help="the model the runs started from (a directory)")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="validation rows, template and scoring")
    parser.add_argument("--samples", type=int, help="validation rows scored (default grpo.max_val_samples)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for path in [args.base, *args.runs]:
        if not path.is_dir():
            parser.error(f"{path} is not a directory")
    cfg = load_config([str(args.recipe)], [f"policy.model_name={args.base}"], Registry.discover())
    options = eval_options(argparse.Namespace(eval_samples=args.samples, eval_batch_size=None,
                                              eval_max_new_tokens=None), cfg)
    with tempfile.TemporaryDirectory(prefix="grpo-heldout-") as tmp:
        base = evaluate(model_dir(args.base, Path(tmp)), cfg, **options)
        runs = {str(run): evaluate(model_dir(run, Path(tmp)), cfg, **options) for run in args.runs}
    gains = [r["accuracy"] - base["accuracy"] for r in runs.values()]
    summary = {"base": base, "runs": runs, "gain_mean": statistics.mean(gains),
               "gain_stderr": statistics.stdev(gains) / math.sqrt(len(gains)) if len(gains) > 1 else None}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    for name, r in [("base", base), *runs.items()]:
        print(f"{name}: {r['accuracy']:.3f} ({r['correct']}/{r['samples']}), mean length {r['mean_length']:.1f}, "
              f"cut off {r['truncated_fraction']:.0%}, boxed {r['boxed_fraction']:.0%}, {r['seconds']:.0f} s")
    stderr = summary["gain_stderr"]
    print(f"gain over base: {summary['gain_mean']:+.3f}" + (f" +- {stderr:.3f} (standard error, n={len(gains)})"
                                                             if stderr is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
