"""GPU check of the megatron policy backend: run on a machine with an NVIDIA GPU (issue 18 item 4).

A ~1.1B Llama-shaped model (TinyLlama-1.1B's shape: hidden 2048, 22 layers, 32 heads, 4 KV heads,
intermediate 5632, vocab 32000) is written, randomly initialised in bfloat16, to a temporary
directory with a locally built word-level tokenizer: nothing comes from a hub and nothing is fetched
at run time. From that directory the megatron policy (Megatron-Core through mbridge) and the hf
policy are built on CUDA and checked:

1. logprob agreement in float32 (TF32 off) on 8 rows x 1024 tokens (left-padded prompts,
   right-padded responses), max |diff| within ``FP32_TOL``;
2. logprob agreement in bfloat16, judged against the float32 hf logprobs: bfloat16 rounding alone
   moves logprobs by ~1e-2 nats, so a fixed tolerance would be a guess. The megatron policy must be
   as close to the float32 truth as the hf policy in bfloat16 is (``BF16_MEAN_FACTOR``,
   ``BF16_MAX_FACTOR`` and the small absolute slacks beside them);
3. 5 training steps of the megatron policy in bfloat16 on 32 rows x 1024 tokens (the shared
   ``ClippedPGLoss``, random advantages, micro-batches of 4): finite losses and gradient norms,
   the policy's logprobs move. Each step is timed (seconds, tokens/s, peak GPU memory); the hf
   policy's steps on the same batches are timed beside them.

Prints the numbers and one PASS/FAIL line per check and exits 1 on a failure (2: refused, no CUDA
without ``--tiny``). ``--json PATH`` also writes the numbers. ``--tiny`` runs the same checks on a
tiny model (a few seconds on CPU, with the test-only CPU shims); it is the smoke test of this script,
not a measurement::

    bash benchmarks/gpu/megatron_wheels.sh          # where there is network: wheels into .whl/megatron
    bash benchmarks/gpu/run_check_megatron.sh 0.16.1 # on the GPU machine: installs them, runs this
    python benchmarks/gpu/check_megatron.py          # or directly, where megatron-core and mbridge are installed
    OMP_NUM_THREADS=1 python benchmarks/gpu/check_megatron.py --tiny   # CPU smoke (the megatron lane's venv)

What the policy itself does for machines like the GPU one planned for (each found by this script;
``grpo_sdk.backends.megatron.bridging`` and ``policy.init_parallel_state``): seeds Megatron's
model-parallel RNG on CUDA, builds with Megatron-Core's local layer spec where Transformer Engine
does not import, turns ``masked_softmax_fusion`` off where Apex's ``scaled_masked_softmax_cuda`` is
absent, and gives mbridge 0.15.1 the ``ModelType.encoder_and_decoder`` megatron-core 0.19 removed.
The script only reports which of these applied.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # TinyLlama-1.1B's shape: 1.10e9 parameters with untied embeddings.
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=32000),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
# rows, prompt tokens, response tokens, compared rows, micro-batch rows, steps
SIZES = {"1b": dict(rows=32, prompt=256, response=768, compare_rows=8, micro=4, steps=5),
         "tiny": dict(rows=8, prompt=12, response=20, compare_rows=4, micro=2, steps=5)}
# float32 on CPU agrees to ~1e-6 (tests/backends/test_megatron.py, tolerance 1e-5). On CUDA with TF32 off the
# fused QKV / gate-up GEMMs of Megatron reduce in another order than hf's separate ones; over 22
# layers and 1024 tokens 1e-3 nats is a bound chosen before any GPU run, not a measured one.
FP32_TOL = {"cpu": 1e-5, "cuda": 1e-3}
BF16_MEAN_FACTOR, BF16_MEAN_SLACK = 2.0, 1e-3
BF16_MAX_FACTOR, BF16_MAX_SLACK = 2.0, 0.05


def build_model_dir(out: Path, shape: dict, device: str) -> Path:
    """A randomly initialised Llama and a word-level tokenizer of the same vocabulary, saved in bf16."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(len(vocab), shape["vocab_size"])})
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    config = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         # Wider than the default 0.02 so the logprobs spread over several nats and a
                         # swapped or dropped weight shows in the comparison.
                         initializer_range=0.05)
    torch.manual_seed(1234)
    # Built on the device: initialising 1.1e9 parameters on the CPU alone takes longer than the checks.
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        with torch.no_grad():
            # Random init leaves the norms at exactly 1: perturb them so a dropped norm shows.
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out


def synthetic_batch(sizes: dict, vocab: int, seed: int):
    """Left-padded prompts + right-padded responses of random tokens (as the loop lays rows out),
    random advantages; at least half of each part is real tokens."""
    import torch

    from grpo_sdk.core.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    rows, prompt, response = sizes["rows"], sizes["prompt"], sizes["response"]
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    prompt_lens = torch.randint(prompt // 2, prompt + 1, (rows,), generator=g)
    response_lens = torch.randint(response // 2, response + 1, (rows,), generator=g)
    pos = torch.arange(prompt + response)
    prompt_mask = (pos[None] >= prompt - prompt_lens[:, None]) & (pos[None] < prompt)
    response_mask = (pos[None] >= prompt) & (pos[None] < prompt + response_lens[:, None])
    attention = (prompt_mask | response_mask).long()
    token_mask = response_mask.float()
    return TrainBatch(input_ids=ids * attention, attention_mask=attention, token_mask=token_mask,
                      sample_mask=torch.ones(rows), generation_logprobs=torch.zeros(ids.shape),
                      group_ids=torch.arange(rows) // 8, rewards=torch.zeros(rows),
                      advantages=torch.randn(rows, 1, generator=g).expand_as(token_mask).contiguous())


def machine_adaptations(device: str) -> list[str]:
    """Which of the policy's adaptations to a missing kernel or a newer megatron-core apply here."""
    from megatron.core.enums import ModelType

    from grpo_sdk.backends.megatron import bridging

    found = []
    if not bridging.has_transformer_engine():
        found.append("local layer spec (no transformer_engine)")
    if not bridging.has_fused_softmax_kernel():
        found.append("masked_softmax_fusion off (no Apex scaled_masked_softmax_cuda)")
    if not hasattr(ModelType, "encoder_and_decoder"):
        found.append("mbridge ModelType.encoder_and_decoder (gone in megatron-core >= 0.19)")
    if device == "cpu":
        found.append("CPU shims (grpo_sdk.backends.megatron.cpu_shims)")
    return found


def make_context(model_dir: Path, registry, device: str, precision: str, sizes: dict):
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext

    rows = sizes["rows"]
    cfg = load_config(None, [f"policy.model_name={model_dir}", f"policy.precision={precision}",
                             f"policy.train_micro_batch_size={sizes['micro']}",
                             f"policy.logprob_batch_size={sizes['micro']}",
                             f"policy.max_total_sequence_length={sizes['prompt'] + sizes['response']}",
                             f"grpo.num_prompts_per_step={rows // 8}", "grpo.num_generations_per_prompt=8",
                             "policy.optimizer.lr=1e-5", "policy.max_grad_norm=1.0",
                             "loss_fn.reference_policy_kl_penalty=0.0"], registry)
    return RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                      device=device, seed=0, needs_reference=False)


def release_memory() -> None:
    """After the last reference to a policy is dropped: its device memory back before the next build."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Checks:
    def __init__(self):
        self.failures: list[str] = []

    def __call__(self, name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        if not ok:
            self.failures.append(name)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def train_steps(policy, loss, sizes: dict, vocab: int, device: str, label: str) -> list[dict]:
    """``sizes['steps']`` GRPO-shaped steps: logprobs of the batch as prev/generation logprobs (ratio 1,
    as in a first on-policy step), then ``policy.train``; each timed."""
    import torch

    rows = []
    for step in range(sizes["steps"]):
        batch = synthetic_batch(sizes, vocab, seed=100 + step)
        sync(device)
        start = time.perf_counter()
        prev = policy.logprobs(batch)
        sync(device)
        logprob_s = time.perf_counter() - start
        batch.prev_logprobs = batch.generation_logprobs = prev
        start = time.perf_counter()
        metrics = policy.train(batch, loss)
        sync(device)
        step_s = time.perf_counter() - start
        tokens = int(batch.attention_mask.sum())
        row = {"step": step + 1, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
               "train_s": step_s, "logprobs_s": logprob_s, "tokens": tokens, "train_tokens_per_s": tokens / step_s}
        if device == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        print(f"  {label} step {step + 1}: loss {row['loss']:+.5f}  grad_norm {row['grad_norm']:.4f}  "
              f"train {step_s:.3f} s ({row['train_tokens_per_s']:,.0f} tok/s, {tokens} tokens)  "
              f"logprobs {logprob_s:.3f} s" + (f"  peak {row['peak_gib']:.1f} GiB" if device == "cuda" else ""),
              flush=True)
    return rows


def compare(a, b, keep) -> tuple[float, float]:
    d = (a[keep] - b[keep]).abs()
    return float(d.max()), float(d.mean())


def run(args) -> int:
    import torch

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.backends.megatron.config import MegatronPolicyConfig
    from grpo_sdk.backends.megatron.policy import MegatronPolicy
    from grpo_sdk.plugins.registry import Registry

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print("refused: no CUDA device; the 1B check needs a GPU (use --tiny for the CPU smoke run)", flush=True)
        return 2
    size = "tiny" if args.tiny else "1b"
    shape, sizes = SHAPES[size], dict(SIZES[size])
    if args.steps is not None:
        sizes["steps"] = args.steps
    if device == "cuda":
        # The float32 comparison is of float32 arithmetic: TF32 would make it a 1e-2 one.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from importlib.metadata import version

    versions = {name: version(name) for name in ("megatron-core", "mbridge", "transformers", "torch")}
    report: dict = {"size": size, "device": device, "shape": shape, "sizes": sizes, "versions": versions}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    print(f"megatron check ({size}) on {report.get('gpu', device)}: "
          + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    checks = Checks()
    t_all = time.perf_counter()
    if device == "cuda":
        torch.cuda.set_device(0)
    report["adaptations"] = machine_adaptations(device)
    print(f"the policy adapts to this machine with: {report['adaptations'] or 'nothing'}", flush=True)
    registry = Registry.discover()

    with tempfile.TemporaryDirectory(prefix="check-megatron-") as tmp:
        start = time.perf_counter()
        model_dir = build_model_dir(Path(tmp) / "llama", shape, device)
        n_params = None
        report["model_build_s"] = time.perf_counter() - start
        print(f"model written in {report['model_build_s']:.1f} s", flush=True)

        compare_sizes = dict(sizes, rows=sizes["compare_rows"])
        batch = synthetic_batch(compare_sizes, shape["vocab_size"], seed=7)
        keep = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
        keep[:, 1:] = batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
        report["compared_tokens"] = int(keep.sum())

        lp = {}
        for precision in ("float32", "bfloat16"):
            context = make_context(model_dir, registry, device, precision, sizes)
            for name, build in (("hf", lambda: HFPolicy(None, context)),
                                ("megatron", lambda: MegatronPolicy(MegatronPolicyConfig(), context))):
                start = time.perf_counter()
                policy = build()
                built = time.perf_counter() - start
                if n_params is None:
                    n_params = sum(p.numel() for p in policy.params)
                lp[name, precision] = policy.logprobs(batch)
                report[f"{name}_{precision}_build_s"] = built
                print(f"  {name} {precision}: built in {built:.1f} s", flush=True)
                policy = None
                release_memory()
        report["parameters"] = n_params
        span = lp["hf", "float32"][keep]
        print(f"{n_params:,} parameters; {report['compared_tokens']} compared tokens; hf float32 "
              f"logprobs span {float(span.min()):.2f}..{float(span.max()):.2f}", flush=True)

        fp32_max, fp32_mean = compare(lp["megatron", "float32"], lp["hf", "float32"], keep)
        report.update(fp32_max_diff=fp32_max, fp32_mean_diff=fp32_mean)
        checks("logprobs float32", fp32_max <= FP32_TOL[device],
               f"megatron vs hf max |diff| {fp32_max:.3e}, mean {fp32_mean:.3e} (tolerance {FP32_TOL[device]:.0e})")

        truth = lp["hf", "float32"]
        hf_max, hf_mean = compare(lp["hf", "bfloat16"], truth, keep)
        mc_max, mc_mean = compare(lp["megatron", "bfloat16"], truth, keep)
        direct_max, direct_mean = compare(lp["megatron", "bfloat16"], lp["hf", "bfloat16"], keep)
        report.update(bf16_hf_vs_fp32_max=hf_max, bf16_hf_vs_fp32_mean=hf_mean, bf16_megatron_vs_fp32_max=mc_max,
                      bf16_megatron_vs_fp32_mean=mc_mean, bf16_megatron_vs_hf_max=direct_max,
                      bf16_megatron_vs_hf_mean=direct_mean)
        ok = (mc_mean <= BF16_MEAN_FACTOR * hf_mean + BF16_MEAN_SLACK
              and mc_max <= BF16_MAX_FACTOR * hf_max + BF16_MAX_SLACK)
        checks("logprobs bfloat16", ok,
               f"vs hf float32: megatron max {mc_max:.3e} mean {mc_mean:.3e}; hf bf16 max {hf_max:.3e} "
               f"mean {hf_mean:.3e} (megatron within {BF16_MEAN_FACTOR:g}x hf's mean + {BF16_MEAN_SLACK:g}, "
               f"{BF16_MAX_FACTOR:g}x its max + {BF16_MAX_SLACK:g}); megatron vs hf bf16 directly max "
               f"{direct_max:.3e} mean {direct_mean:.3e}")
        del lp

        context = make_context(model_dir, registry, device, "bfloat16", sizes)
        loss = ClippedPGLoss(context.config.loss_fn)
        results = {}
        for name in ("megatron",) + (() if args.skip_hf_train else ("hf",)):
            policy = (MegatronPolicy(MegatronPolicyConfig(), context) if name == "megatron"
                      else HFPolicy(None, context))
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            probe = synthetic_batch(compare_sizes, shape["vocab_size"], seed=7)
            before = policy.logprobs(probe)
            print(f"{name} bfloat16 training, {sizes['rows']} rows x {sizes['prompt'] + sizes['response']} "
                  f"tokens, micro-batches of {sizes['micro']}:", flush=True)
            rows = train_steps(policy, loss, sizes, shape["vocab_size"], device, name)
            moved = float((policy.logprobs(probe) - before)[keep].abs().mean())
            results[name] = {"steps": rows, "logprob_change_mean": moved}
            policy = None
            release_memory()
        report["train"] = results

        mrows = results["megatron"]["steps"]
        finite = all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in mrows)
        checks("train steps", finite and results["megatron"]["logprob_change_mean"] > 0,
               f"{len(mrows)} steps, losses {[round(r['loss'], 5) for r in mrows]}, grad norms "
               f"{[round(r['grad_norm'], 4) for r in mrows]}, mean |logprob change| "
               f"{results['megatron']['logprob_change_mean']:.3e}")
        if "hf" in results:
            # Same weights and batches, so step 1's gradient norms differ only by bfloat16 rounding.
            pairs = [(m["grad_norm"], h["grad_norm"]) for m, h in zip(mrows, results["hf"]["steps"])]
            report["grad_norm_rel_diff_step1"] = abs(pairs[0][0] - pairs[0][1]) / max(pairs[0][1], 1e-12)
            print(f"grad norms megatron / hf: {[f'{m:.4g}/{h:.4g}' for m, h in pairs]} (not a check: "
                  f"bfloat16; step 1 relative diff {report['grad_norm_rel_diff_step1']:.2e})", flush=True)
        # The first step pays for allocator growth and kernel selection: the steady figure leaves it out.
        for name, res in results.items():
            steady = [r["train_s"] for r in res["steps"][1:]] or [res["steps"][0]["train_s"]]
            tokens = statistics.mean(r["tokens"] for r in res["steps"])
            res["steady_train_s"] = statistics.median(steady)
            res["steady_tokens_per_s"] = tokens / res["steady_train_s"]
            res["peak_gib"] = max((r.get("peak_gib", 0.0) for r in res["steps"]), default=0.0)
            print(f"{name}: step {res['steady_train_s']:.3f} s (median of steps 2..), "
                  f"{res['steady_tokens_per_s']:,.0f} tokens/s" +
                  (f", peak GPU memory {res['peak_gib']:.1f} GiB" if device == "cuda" else ""), flush=True)

    report["total_s"] = time.perf_counter() - t_all
    report["failures"] = checks.failures
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"\ntotal {report['total_s']:.1f} s; "
          + (f"{len(checks.failures)} failed: {checks.failures}" if checks.failures else "all checks passed"),
          flush=True)
    return 1 if checks.failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model: the smoke run of this script (CPU or GPU)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 5)")
    parser.add_argument("--skip-hf-train", action="store_true", help="do not time the hf policy's steps")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    try:
        return run(args)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    # Nothing is fetched at run time: the model and tokenizer are written locally.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.exit(main())
