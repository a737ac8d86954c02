"""GPU check of the vLLM backend with the official `vllm` wheel: run on a machine with an NVIDIA GPU.

A tiny Llama built locally (no model hub needed) trains 5 GRPO steps with vLLM generation and the
hf policy on CUDA, three ways (plain, colocated sleep/wake, top-k/top-p): at every step the
generation logprobs must match the policy's (token_mult_prob_error within 2e-3 of 1), across the
weight syncs (versions 0..4), as tests/backends/test_vllm.py checks on CPU. Prints one PASS/FAIL line per
check and exits non-zero on a failure::

    pip install -e '.[vllm]'  &&  python benchmarks/gpu/check_vllm.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_llama(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_sdk.recipes.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def check(name: str, ok: bool, detail: str, failures: list[str]) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def main() -> int:
    import torch

    failures: list[str] = []
    assert torch.cuda.is_available(), "this check needs a CUDA device"
    with tempfile.TemporaryDirectory() as tmp:
        model = build_llama(Path(tmp) / "llama")
        common = [f"policy.model_name={model}", "policy.generation.backend=vllm", "cluster.device=cuda",
                  "policy.generation.vllm.gpu_memory_utilization=0.2", "grpo.val_period=0",
                  "policy.max_total_sequence_length=64"]
        for label, extra in [("grpo steps", []),
                             ("grpo steps, sleep mode", ["policy.generation.vllm.enable_sleep_mode=true"]),
                             ("grpo steps, top-k/top-p", ["policy.generation.top_k=8", "policy.generation.top_p=0.9",
                                                          "policy.generation.temperature=0.8"])]:
            start = time.time()
            run = Path(tmp) / label.replace(" ", "_").replace(",", "").replace("/", "")
            result = subprocess.run([sys.executable, "-m", "grpo_sdk.cli.app", "run", "--run-dir", str(run),
                                     "grpo.max_num_steps=5", *common, *extra], capture_output=True, text=True)
            if result.returncode != 0:
                check(label, False, result.stderr[-2000:], failures)
                continue
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            errors = [r["token_mult_prob_error"] for r in rows]
            versions = [r["generation/weight_version"] for r in rows]
            check(label, max(abs(e - 1) for e in errors) < 2e-3 and versions == [0, 1, 2, 3, 4],
                  f"token_mult_prob_error {[round(e, 5) for e in errors]}, versions {versions}, "
                  f"{time.time() - start:.0f} s", failures)
    print(f"\n{len(failures)} failed" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
