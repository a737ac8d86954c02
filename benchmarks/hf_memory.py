"""Memory and step time of the hf backend's switches, each contender in a fresh process, alternated.

* ``share``: a short GRPO run (the built-in reverse-digits task, 4 prompts x 4 generations, 3 steps,
  no validation, no checkpoints) on a GPT-2 of ~25M parameters (8 layers, d_model 512), with
  ``policy.generation.hf.share_policy_model`` true (the generation samples with the policy's module)
  and false (a second copy, refit every step). Prints each run's peak RSS and the ratio.
* ``train``: one policy, three optimizer steps on a fixed batch (rows x tokens, the whole sequence
  trained) of the same model, as is, with ``policy.hf.gradient_checkpointing`` and with
  ``policy.hf.autocast=bfloat16``: the peak RSS the steps add above the process after setup
  (activations, gradients and the AdamW state, which is the same in every variant), and the median
  step time of steps 2-4.

Peak RSS is ``ru_maxrss`` of the child process. Run from the repo root::

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/hf_memory.py --rounds 2

``--tiny`` shrinks everything (a 2-layer d_model-64 model) to check the script runs.
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


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def current_rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_model(out: Path, tiny: bool) -> Path:
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    if tiny:
        return build_tiny_gpt2(out, seed=0, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    return build_tiny_gpt2(out, seed=0, n_embd=512, n_layer=8, n_head=8, n_positions=512)


def child_share(model: str, share: str, run_dir: str) -> dict:
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.trainer.trainer import GRPOTrainer

    registry = Registry.discover()
    cfg = load_config(None, [f"policy.model_name={model}", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=3", "grpo.val_period=0",
                             "grpo.val_at_start=false", "checkpointing.enabled=false",
                             f"policy.generation.hf.share_policy_model={share}"], registry)
    trainer = GRPOTrainer(cfg, run_dir=run_dir, registry=registry)
    trainer.setup()
    assert trainer.components.generation.shares_policy_model is (share == "true")
    start = time.perf_counter()
    trainer.train()
    return {"peak_rss_mb": peak_rss_mb(), "seconds": time.perf_counter() - start}


def child_train(model: str, variant: str, rows: int, tokens: int) -> dict:
    import torch

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.backends.hf.config import HFPolicyConfig
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.records import TrainBatch
    from grpo_sdk.plugins.registry import Registry

    registry = Registry.discover()
    cfg = load_config(None, [f"policy.model_name={model}", f"policy.train_micro_batch_size={rows}",
                             f"policy.max_total_sequence_length={tokens}"], registry)
    context = RunContext(config=cfg, run_dir=tempfile.mkdtemp(), model_path=model, tokenizer_path=model,
                         device="cpu", seed=0, needs_reference=False)
    options = HFPolicyConfig(gradient_checkpointing=variant == "checkpointing",
                             autocast="bfloat16" if variant == "autocast" else None)
    policy = HFPolicy(options, context)
    generator = torch.Generator().manual_seed(0)
    vocab = policy.model.config.vocab_size
    ids = torch.randint(4, vocab, (rows, tokens), generator=generator)
    ones = torch.ones((rows, tokens))
    batch = TrainBatch(input_ids=ids, attention_mask=ones.long(), token_mask=ones, sample_mask=torch.ones(rows),
                       generation_logprobs=torch.full((rows, tokens), -3.0), group_ids=torch.zeros(rows).long(),
                       rewards=torch.zeros(rows), advantages=torch.randn((rows, 1), generator=generator).expand(
                           rows, tokens).contiguous())
    loss = ClippedPGLoss(cfg.loss_fn)
    base = current_rss_mb()  # the model and the batch; the steps add activations, gradients, AdamW state
    times = []
    for _ in range(4):
        start = time.perf_counter()
        policy.train(batch, loss)
        times.append(time.perf_counter() - start)
    return {"added_peak_mb": peak_rss_mb() - base, "step_s": statistics.median(times[1:]), "peak_rss_mb": peak_rss_mb(),
            "parameters": sum(p.numel() for p in policy.params)}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of every contender")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer d_model-64 model: checks the script runs")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--only", choices=["share", "train"], default=None)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        result = child_share(*rest) if kind == "share" else child_train(rest[0], rest[1], int(rest[2]), int(rest[3]))
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model", args.tiny))
        rows, tokens = (2, 32) if args.tiny else (args.rows, args.tokens)
        if args.only in (None, "share"):
            peaks: dict[str, list[float]] = {"true": [], "false": []}
            for i in range(args.rounds):
                for share in (("true", "false") if i % 2 == 0 else ("false", "true")):
                    result = run_child("share", model, share, str(Path(tmp) / f"run-{share}-{i}"))
                    peaks[share].append(result["peak_rss_mb"])
                    print(f"share_policy_model={share:5}  peak RSS {result['peak_rss_mb']:7.1f} MB  "
                          f"(3 steps in {result['seconds']:.1f} s)", flush=True)
            shared, copy = statistics.median(peaks["true"]), statistics.median(peaks["false"])
            print(f"peak RSS median: shared {shared:.1f} MB, copy {copy:.1f} MB, shared/copy {shared / copy:.3f}, "
                  f"saved {copy - shared:.1f} MB")
        if args.only in (None, "train"):
            variants = ["plain", "checkpointing", "autocast"]
            found: dict[str, list[dict]] = {v: [] for v in variants}
            for i in range(args.rounds):
                for variant in (variants if i % 2 == 0 else variants[::-1]):
                    result = run_child("train", model, variant, str(rows), str(tokens))
                    found[variant].append(result)
                    print(f"{variant:13}  {result['parameters'] / 1e6:.1f}M params, {rows} x {tokens} tokens: "
                          f"+{result['added_peak_mb']:.1f} MB peak over setup, {result['step_s']:.2f} s/step",
                          flush=True)
            plain_mb = statistics.median(r["added_peak_mb"] for r in found["plain"])
            plain_s = statistics.median(r["step_s"] for r in found["plain"])
            for variant in variants[1:]:
                mb = statistics.median(r["added_peak_mb"] for r in found[variant])
                step = statistics.median(r["step_s"] for r in found[variant])
                print(f"{variant} vs plain: step memory {mb:.1f} / {plain_mb:.1f} MB ({mb / plain_mb:.2f}x), "
                      f"step time {step:.2f} / {plain_s:.2f} s ({step / plain_s:.2f}x)")


if __name__ == "__main__":
    main()
