"""Peak memory of the hf policy's logprobs at a 151,936-token vocabulary (Qwen's), before and after
response-only chunked logits (issue 20, item 1); and the time of a training step, before and after.

Memory: each measurement runs in a fresh process (``--one``) that builds a tiny Llama (hidden 64,
2 layers, vocab 151,936, untied head; ~20M parameters, nearly all in the embeddings), takes a
batch of B=4 rows of S=512 tokens whose second half is the response, and runs one of

* ``before``: the previous ``sequence_logprobs`` (one forward over every position, the
  ``[B, S-1, V]`` float32 logits, log-softmax over all of them), copied below;
* ``after``: ``grpo_sdk.backends.hf.forward.sequence_logprobs`` (response positions only, chunks
  of ``policy.logprob_chunk_size`` positions; default: 64 MiB of float32 logits);
* ``baseline``: the model built and the batch made, nothing run;

either without gradients (``logprobs``: old/reference/teacher logprobs) or as a training
micro-batch (``train``: forward, a loss on the response positions, backward). It reports the
process's peak RSS (``ru_maxrss``); the table shows each over the baseline and the after/before
ratio. Plain CPU tensors: the figures are bytes the process touched.

Time (``--time``): a training micro-batch step (forward + backward, no optimizer) on a ~25M
parameter GPT-2 (n_embd 512, 8 layers, the built-in recipe's 24-token vocabulary, B=16, S=96 with
a 48-token response), ``before`` and ``after`` alternated ``--repeats`` times in one process, one
thread; median seconds.

Padding (``--padding``): ``HFPolicy.train`` (forward, backward, AdamW step) on a long-tailed batch
(32 rows, 8-token prompts, responses 5..256 tokens from a Pareto tail, shape 0.8: median 9, max 226) with padded
micro-batches of 8 rows, with ``policy.dynamic_batching`` and with ``policy.sequence_packing``
(budgets of 8 rows x the batch's width, the padded path's), alternated; a ~3.2M-parameter GPT-2 (n_embd 256,
4 layers), one thread; median seconds.

    PYTHONPATH=src python benchmarks/logprob_memory.py            # memory table
    PYTHONPATH=src python benchmarks/logprob_memory.py --time     # step time
    PYTHONPATH=src python benchmarks/logprob_memory.py --padding  # padded / dynamic / packed train
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from grpo_sdk.backends.hf.forward import position_ids_for, sequence_logprobs
from grpo_sdk.plugins.tensors import process_logits, token_logprobs

VOCAB, B, S = 151_936, 4, 512


def before(model, input_ids, attention_mask, *, temperature, top_k, top_p, token_mask=None, chunk_size=None):
    """The previous implementation (every position's float32 logits at once)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_for(attention_mask), use_cache=False).logits
    scaled = logits[:, :-1].float() / temperature
    return torch.nn.functional.pad(token_logprobs(process_logits(scaled, 1.0, top_k, top_p), input_ids[:, 1:]), (1, 0))


def after(model, input_ids, attention_mask, **kwargs):
    return sequence_logprobs(model, input_ids, attention_mask, **kwargs)


def batch(vocab: int, rows: int, width: int, response: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    token_mask = torch.zeros(rows, width)
    token_mask[:, width - response:] = 1
    return ids, torch.ones(rows, width, dtype=torch.long), token_mask


def llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def one(variant: str, mode: str, chunk: int | None) -> dict:
    model = llama(VOCAB)
    ids, mask, token_mask = batch(VOCAB, B, S, S // 2)
    fn = {"before": before, "after": after}.get(variant)
    sampling = dict(temperature=1.0, top_k=None, top_p=1.0, token_mask=token_mask, chunk_size=chunk)
    start = time.perf_counter()
    if fn is not None and mode == "logprobs":
        with torch.no_grad():
            fn(model, ids, mask, **sampling)
    elif fn is not None:
        (fn(model, ids, mask, **sampling) * token_mask).sum().backward()
    seconds = time.perf_counter() - start
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": seconds}


def memory_table(chunk: int | None) -> None:
    runs = {}
    for mode in ("logprobs", "train"):
        for variant in ("baseline", "before", "after"):
            out = subprocess.run([sys.executable, __file__, "--one", variant, mode]
                                 + ([f"--chunk={chunk}"] if chunk else []),
                                 capture_output=True, text=True, check=True)
            runs[variant, mode] = json.loads(out.stdout.strip().splitlines()[-1])
    logits_mib = B * (S - 1) * VOCAB * 4 / 2**20
    print(f"vocab {VOCAB:,}, B={B}, S={S} (response {S // 2} tokens per row); one float32 [B, S-1, V] = "
          f"{logits_mib:,.0f} MiB; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"{'mode':<10}{'baseline MiB':>14}{'before +MiB':>13}{'after +MiB':>12}{'after/before':>14}"
          f"{'before s':>10}{'after s':>9}")
    for mode in ("logprobs", "train"):
        base = runs["baseline", mode]["peak_rss_mib"]
        b, a = (runs[v, mode]["peak_rss_mib"] - base for v in ("before", "after"))
        print(f"{mode:<10}{base:>14,.0f}{b:>13,.0f}{a:>12,.0f}{a / b:>14.3f}"
              f"{runs['before', mode]['seconds']:>10.2f}{runs['after', mode]['seconds']:>9.2f}")


def step_time(repeats: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=24, n_positions=128, n_embd=512, n_layer=8, n_head=8,
                                       bos_token_id=0, eos_token_id=0)).eval()
    params = sum(p.numel() for p in model.parameters())
    ids, mask, token_mask = batch(24, 16, 96, 48)
    sampling = dict(temperature=1.0, top_k=None, top_p=1.0, token_mask=token_mask)
    times = {"before": [], "after": []}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for name, fn in (("before", before), ("after", after)):
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            (fn(model, ids, mask, **sampling) * token_mask).sum().backward()
            times[name].append(time.perf_counter() - start)
    b, a = (statistics.median(times[n][1:]) for n in ("before", "after"))
    print(f"GPT-2 {params / 1e6:.1f}M parameters, vocab 24, B=16, S=96 (48 response tokens), forward + backward, "
          f"{torch.get_num_threads()} thread(s), median of {repeats}: before {b:.3f} s, after {a:.3f} s, "
          f"after/before {a / b:.3f}")


def padding_time(repeats: int) -> None:
    import tempfile
    from pathlib import Path

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.records import TrainBatch
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    rows, prompt, longest = 32, 8, 256
    g = torch.Generator().manual_seed(0)
    lengths = (5 * (1 - torch.rand(rows, generator=g)) ** (-1 / 0.8)).long().clamp(5, longest).tolist()
    width = prompt + max(lengths)  # padded to the batch's longest row, as the loop pads
    ids = torch.randint(4, 20, (rows, width), generator=g)
    mask = torch.zeros(rows, width, dtype=torch.long)
    token_mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths):
        mask[i, :prompt + n] = 1
        token_mask[i, prompt:prompt + n] = 1
    data = TrainBatch(input_ids=ids, attention_mask=mask, token_mask=token_mask, sample_mask=torch.ones(rows),
                      generation_logprobs=torch.zeros(ids.shape), group_ids=torch.arange(rows) // 8,
                      rewards=torch.zeros(rows), advantages=torch.randn(rows, 1, generator=g).expand(rows, width))
    registry = Registry.discover()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_gpt2(Path(tmp) / "m", seed=0, n_embd=256, n_layer=4, n_head=4,
                                    n_positions=prompt + longest)
        policies = {}
        budget = 8 * width
        for name, extra in (("padded", []),
                            ("dynamic", ["policy.dynamic_batching.enabled=true",
                                         f"policy.dynamic_batching.train_mb_tokens={budget}"]),
                            ("packed", ["policy.sequence_packing.enabled=true",
                                        f"policy.sequence_packing.train_mb_tokens={budget}"])):
            cfg = load_config(None, [f"policy.model_name={model_dir}", "policy.train_micro_batch_size=8",
                                     f"policy.max_total_sequence_length={width}", "policy.generation.max_new_tokens=8",
                                     "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8", *extra],
                              registry)
            context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir),
                                 tokenizer_path=str(model_dir), device="cpu", seed=0, needs_reference=False)
            policies[name] = (HFPolicy(None, context), ClippedPGLoss(cfg.loss_fn))
        times = {name: [] for name in policies}
        for _ in range(repeats + 1):
            for name, (policy, loss_fn) in policies.items():
                start = time.perf_counter()
                policy.train(data, loss_fn)
                times[name].append(time.perf_counter() - start)
    real = sum(lengths) + rows * prompt
    print(f"GPT-2 n_embd 256, 4 layers; {rows} rows, responses {min(lengths)}..{max(lengths)} tokens (median "
          f"{statistics.median(lengths):.0f}); real tokens {real} of {rows * width} padded; one thread; median of "
          f"{repeats} train calls:")
    base = statistics.median(times["padded"][1:])
    for name, values in times.items():
        median = statistics.median(values[1:])
        print(f"  {name:<8} {median:.3f} s  ({median / base:.2f}x padded)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=None, help="policy.logprob_chunk_size (default: null)")
    parser.add_argument("--time", action="store_true", help="time a training micro-batch step instead")
    parser.add_argument("--padding", action="store_true", help="time padded / dynamic / packed training")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(one(*args.one, args.chunk)))
    elif args.time:
        step_time(args.repeats)
    elif args.padding:
        padding_time(args.repeats)
    else:
        memory_table(args.chunk)


if __name__ == "__main__":
    main()
