"""Time the GRPO advantage estimator plus the clipped PG loss, forward and backward, on logprob inputs.

No model: random input-aligned logprobs for 512 sequences x 2048 positions (64 prompt groups x 8
generations, a 128-token prompt, ragged response lengths), with ``requires_grad`` on the current
logprobs as a model would give them. One timed run is

    advantages = GRPOEstimator.compute_advantages(rewards, group_ids, mask)
    loss, metrics = ClippedPGLoss(cfg)(logprobs, batch, global counts)   # metrics -> floats too
    loss.backward()

for a few ``loss_fn`` option sets; the table shows the median of ``--runs`` runs after one warm-up
run, in ms and in token positions per second (B x S per run). Everything is vectorised torch; the
thread count is set before torch is imported (OMP_NUM_THREADS) and per pass with
``torch.set_num_threads``. Run from the repo root (dev venv)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/loss_benchmark.py --runs 5 --threads 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # must precede `import torch`

import torch  # noqa: E402

from grpo_sdk.algorithms.loss import ClippedPGLoss  # noqa: E402
from grpo_sdk.config.schema import LossConfig  # noqa: E402
from grpo_sdk.core.records import TrainBatch  # noqa: E402
from grpo_sdk.estimators.grpo import GRPOEstimator  # noqa: E402

GROUPS, GENERATIONS, SEQ_LEN, PROMPT_LEN = 64, 8, 2048, 128

OPTION_SETS = {
    "default (no KL)": {"reference_policy_kl_penalty": 0.0},
    "KL k3 (beta 0.01)": {"reference_policy_kl_penalty": 0.01, "reference_policy_kl_type": "k3"},
    "GSPO": {"reference_policy_kl_penalty": 0.0, "sequence_level_importance_ratios": True, "token_level_loss": False},
    "IS + tis": {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                 "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
    "dual clip c=3": {"reference_policy_kl_penalty": 0.0, "ratio_clip_c": 3.0},
}


def make_inputs(seed: int = 0) -> tuple[torch.Tensor, TrainBatch]:
    """Current logprobs (with grad) and a batch whose old/sampler/reference logprobs are nearby."""
    g = torch.Generator().manual_seed(seed)
    rows = GROUPS * GENERATIONS
    prev = -torch.rand(rows, SEQ_LEN, generator=g) * 3
    prev[:, 0] = 0.0  # input-aligned: column 0 has no logprob

    def near(scale: float) -> torch.Tensor:
        return prev + scale * torch.randn(rows, SEQ_LEN, generator=g)

    lengths = torch.randint(64, SEQ_LEN - PROMPT_LEN + 1, (rows,), generator=g)
    positions = torch.arange(SEQ_LEN)
    token_mask = ((positions >= PROMPT_LEN) & (positions < PROMPT_LEN + lengths[:, None])).float()
    batch = TrainBatch(
        input_ids=torch.zeros(rows, SEQ_LEN, dtype=torch.long),
        attention_mask=torch.ones(rows, SEQ_LEN, dtype=torch.long), token_mask=token_mask,
        sample_mask=torch.ones(rows), generation_logprobs=near(0.05),
        group_ids=torch.arange(rows) // GENERATIONS,
        rewards=(torch.rand(rows, generator=g) < 0.4).float(), prev_logprobs=prev, reference_logprobs=near(0.2))
    return near(0.1).requires_grad_(True), batch


def one_run(estimator: GRPOEstimator, loss_fn: ClippedPGLoss, logprobs: torch.Tensor, batch: TrainBatch) -> float:
    logprobs.grad = None
    start = time.perf_counter()
    mask = batch.token_mask * batch.sample_mask[:, None]
    batch.advantages = estimator.compute_advantages(batch.rewards, batch.group_ids, mask)
    loss, _ = loss_fn(logprobs, batch, global_valid_seqs=batch.sample_mask.sum(),
                      global_valid_toks=mask[:, 1:].sum())
    loss.backward()
    elapsed = time.perf_counter() - start
    if not torch.isfinite(loss) or logprobs.grad is None:
        raise RuntimeError(f"bad run: loss {loss.item()}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per option set (median reported)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch thread counts to time")
    args = parser.parse_args()

    logprobs, batch = make_inputs()
    positions = batch.token_mask.numel()
    valid = int(batch.token_mask[:, 1:].sum())
    estimator = GRPOEstimator(None, None)
    print(f"{batch.batch_size} sequences x {SEQ_LEN} positions ({valid} response tokens), "
          f"{GROUPS} groups x {GENERATIONS}; median of {args.runs} runs, torch {torch.__version__}")
    print(f"{'threads':>7}  {'options':<20} {'ms':>9} {'Mtok/s':>8}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, options in OPTION_SETS.items():
            loss_fn = ClippedPGLoss(LossConfig(**options))
            one_run(estimator, loss_fn, logprobs, batch)  # warm-up
            seconds = statistics.median(one_run(estimator, loss_fn, logprobs, batch) for _ in range(args.runs))
            print(f"{threads:>7}  {name:<20} {seconds * 1e3:>9.1f} {positions / seconds / 1e6:>8.2f}")


if __name__ == "__main__":
    main()
