"""One GRPO step's optimizer steps: global batches of micro-batches, as every policy backend runs them.

The rows of a step are split into global batches of ``policy.train_global_batch_size`` rows (one
optimizer step each), and each global batch into micro-batches whose gradients accumulate. The loss
divides by the token and sequence counts of the WHOLE global batch (on a data-parallel rank too), so
the accumulated gradient does not depend on how the rows are split, and the ranks' gradients sum to
the single-process one. Then the survivor normalisation (``SurvivorNormalizedLoss``), clipping to
``policy.max_grad_norm``, the optimizer and LR-schedule steps. A non-finite loss or gradient stops
with ``NonFiniteError`` naming the optimizer step and rows; every rank still runs its backward first,
so no rank waits in a collective for one that failed.

What differs between backends is passed in: how a micro-batch's logprobs are computed, how rows are
shared and metrics reduced over data-parallel ranks, token-budget micro-batches, the gradient norm of
a sharded model. Public as ``grpo_sdk.plugins.training.train_global_batches``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import attrs
import torch

from grpo_sdk.core.errors import NonFiniteError
from grpo_sdk.core.metrics import average_optimizer_steps, sum_micro_batches
from grpo_sdk.core.protocols import LossFunction, SurvivorNormalizedLoss, ZeroGradientRows
from grpo_sdk.core.records import TrainBatch

MicroBatches = Callable[[TrainBatch, "list[int] | None"], "list[list[int] | None]"]


class TrainsGlobalBatches(Protocol):
    """What ``train_global_batches`` reads of a policy, and ``optimizer_steps``, which it counts up
    (one per optimizer step, as each step is taken: the step a failure names)."""

    policy_cfg: Any  # train_global_batch_size, train_micro_batch_size, max_grad_norm
    model: torch.nn.Module  # named_parameters(): the first non-finite gradient's name
    params: list[torch.nn.Parameter]  # what the optimizer steps (and the norm is clipped over)
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch's LRScheduler
    optimizer_steps: int
    device: torch.device
    kl_needs_unfiltered: bool  # logprobs(..., with_unfiltered=True) returns (logprobs, unfiltered)


@attrs.frozen
class _Step:
    """One global batch: this rank's rows of it, and the counts of all of it (every rank's)."""

    batch: TrainBatch
    first_row: int  # of the step's batch: names rows in errors
    valid_toks: torch.Tensor
    valid_seqs: torch.Tensor


def train_global_batches(policy: TrainsGlobalBatches, batch: TrainBatch, loss_fn: LossFunction, *,
                         logprobs: Callable[..., Any],
                         row_share: Callable[[int, str], tuple[int, int]] | None = None,
                         reduce: Callable[[dict[str, float], bool], tuple[dict[str, float], bool]] | None = None,
                         micro_batches: MicroBatches | None = None,
                         idle_loss: Callable[[TrainBatch], torch.Tensor] | None = None,
                         clip: Callable[[list, float | None], torch.Tensor] | None = None,
                         skip_zero_advantage_rows: bool = False) -> dict[str, float]:
    """``Policy.train``: the step's metrics (the loss's, averaged over optimizer steps), ``grad_norm`` and ``lr``.

    * ``logprobs(micro, with_unfiltered=)``: a micro-batch's input-aligned logprobs (already on the device).
    * Data parallelism: ``row_share(rows, what)`` is this rank's ``(start, stop)`` of a global batch
      (``grpo_sdk.plugins.training.row_share``); ``reduce(metrics, failed)`` returns the whole global
      batch's metrics and whether any rank failed, identical on every rank (``all_reduce_metrics``;
      it also reduces gradients where the model does not). Both None: one process.
    * ``micro_batches(global_batch, rows)``: the row indices of each micro-batch (of ``rows``, default
      all); a ``None`` entry runs ``idle_loss(global_batch).backward()`` (a zero-gradient pass that keeps
      this rank's collectives in step). Default: ``train_micro_batch_size`` rows at a time.
    * ``clip(params, max_norm)``: the whole model's gradient norm after clipping (default torch's
      ``clip_grad_norm_``, a DTensor norm made whole).
    * ``skip_zero_advantage_rows``: run no forward/backward for the rows a ``ZeroGradientRows`` loss
      says have an exact zero gradient (their metrics are made up from the rows that ran).
    """
    cfg = policy.policy_cfg
    rows = batch.batch_size
    global_rows = cfg.train_global_batch_size or rows
    micro_batches = micro_batches or _fixed_micro_batches(cfg.train_micro_batch_size)
    if row_share is not None:  # every global batch is checked before the first collective: all ranks fail alike
        row_share(rows, "policy.train")
        for start in range(0, rows, global_rows):
            stop = min(rows, start + global_rows)
            row_share(stop - start, f"policy.train: the global batch of rows {start}..{stop - 1}")
    step_metrics = []
    for start in range(0, rows, global_rows):
        global_batch = batch.rows(start, start + global_rows)
        # Counts of the WHOLE global batch, also on a data-parallel rank: each rank's loss is then a
        # share of the global loss, and the ranks' gradients sum to the full gradient.
        token_mask = global_batch.token_mask[:, 1:] * global_batch.sample_mask[:, None]
        valid_toks, valid_seqs = token_mask.sum(), global_batch.sample_mask.sum()
        first = 0
        if row_share is not None:
            first, stop = row_share(global_batch.batch_size, "policy.train")
            global_batch = global_batch.rows(first, stop)
        step = _Step(global_batch, start + first, valid_toks, valid_seqs)
        policy.optimizer.zero_grad(set_to_none=True)
        trained = rows_to_train(global_batch, loss_fn) if skip_zero_advantage_rows else None
        metrics, failure = _accumulate(policy, step, loss_fn, logprobs, micro_batches(global_batch, trained),
                                       idle_loss)
        if trained is not None:
            metrics = metrics_of_trained_rows(metrics, loss_fn, global_batch, trained, valid_toks, valid_seqs)
        failed = failure is not None
        if reduce is not None:  # the whole global batch's metrics, identical on every rank
            metrics, failed = reduce(metrics, failed)
        if failed:
            raise NonFiniteError(failure or f"loss is not finite on another data-parallel rank in optimizer "
                                            f"step {policy.optimizer_steps + 1}")
        if isinstance(loss_fn, SurvivorNormalizedLoss) and loss_fn.requires_survivor_normalization:
            # The in-loss logprob-error filter divided by the original counts; only now, after every
            # micro-batch (of every rank), are the surviving counts known.
            factor, (metrics,) = loss_fn.survivor_normalization(
                [metrics], global_valid_seqs=float(valid_seqs), global_valid_toks=float(valid_toks))
            for param in policy.params:
                if param.grad is not None:
                    param.grad.mul_(factor)
        grad_norm = clip_gradients(policy, clip)
        policy.optimizer.step()
        policy.scheduler.step()
        policy.optimizer_steps += 1
        step_metrics.append({**metrics, "grad_norm": grad_norm})
    return {**average_optimizer_steps(step_metrics), "lr": policy.scheduler.get_last_lr()[0]}


def _accumulate(policy: TrainsGlobalBatches, step: _Step, loss_fn: LossFunction, logprobs: Callable[..., Any],
                micro_batches: list[list[int] | None], idle_loss: Callable[[TrainBatch], torch.Tensor] | None
                ) -> tuple[dict[str, float], str | None]:
    """The gradient of one global batch (this rank's rows), accumulated over its micro-batches: the
    summed metrics, and what failed first (None: every loss was finite)."""
    micro_metrics, failure = [], None
    for picked in micro_batches:
        if picked is None:  # zero gradients, so that this rank's collectives match the others'
            idle_loss(step.batch).backward()
            continue
        micro = select_rows(step.batch, picked).to(policy.device)
        extra = {}
        micro_logprobs = logprobs(micro, with_unfiltered=policy.kl_needs_unfiltered)
        if policy.kl_needs_unfiltered:
            micro_logprobs, extra["unfiltered_logprobs"] = micro_logprobs
        loss, metrics = loss_fn(micro_logprobs, micro, global_valid_seqs=step.valid_seqs,
                                global_valid_toks=step.valid_toks, **extra)
        if failure is None and not torch.isfinite(loss):
            failure = (f"loss is {loss.item()} in optimizer step {policy.optimizer_steps + 1}, "
                       f"rows {describe_rows([step.first_row + r for r in picked])}")
        # Backward even after a failure: the other ranks' collectives wait for this rank's.
        loss.backward()
        micro_metrics.append(metrics)
    return sum_micro_batches(micro_metrics), failure


def _fixed_micro_batches(rows_each: int) -> MicroBatches:
    def micro_batches(batch: TrainBatch, rows: list[int] | None) -> list[list[int] | None]:
        rows = list(range(batch.batch_size)) if rows is None else rows
        return [rows[i:i + rows_each] for i in range(0, len(rows), rows_each)]

    return micro_batches


def clip_gradients(policy: TrainsGlobalBatches, clip: Callable[[list, float | None], torch.Tensor] | None = None
                   ) -> float:
    """Clip ``policy.params``' gradients to ``policy.max_grad_norm`` (None: no clipping) and return the
    norm; a non-finite norm is a ``NonFiniteError`` naming the first parameter whose gradient is."""
    max_norm = policy.policy_cfg.max_grad_norm
    if clip is None:
        # Under FSDP2 the norm is a DTensor of the global norm, and clipping scales every shard by it.
        norm = _full(torch.nn.utils.clip_grad_norm_(policy.params, max_norm if max_norm is not None else float("inf")))
    else:
        norm = clip(policy.params, max_norm)
    if not torch.isfinite(norm):
        bad = next((name for name, p in policy.model.named_parameters()
                    if p.grad is not None and not torch.isfinite(_local(p.grad)).all()), "?")
        raise NonFiniteError(f"gradient norm is {norm.item()} in optimizer step {policy.optimizer_steps + 1} "
                             f"(first non-finite gradient: {bad})")
    return float(norm)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is returned as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective); a plain tensor is returned as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def rows_to_train(batch: TrainBatch, loss_fn: LossFunction) -> list[int] | None:
    """The rows the training passes run when rows with an exact zero gradient are skipped (a
    ``ZeroGradientRows`` loss says which); None: all of them."""
    if not isinstance(loss_fn, ZeroGradientRows):
        return None
    idle = loss_fn.zero_gradient_rows(batch)
    if idle is None or not bool(idle.any()):
        return None
    # One row still runs when none is needed: the optimizer then steps on an exact zero gradient
    # (Adam's moments move the weights, as they would have), and the metrics have a value.
    return (~idle).nonzero().flatten().tolist() or [0]


def metrics_of_trained_rows(metrics: dict[str, float], loss_fn: Any, batch: TrainBatch, trained: list[int],
                            valid_toks: torch.Tensor, valid_seqs: torch.Tensor) -> dict[str, float]:
    rows = select_rows(batch, trained)
    mask = rows.token_mask[:, 1:] * rows.sample_mask[:, None]
    metrics = loss_fn.metrics_of_trained_rows(metrics, trained_toks=float(mask.sum()),
                                              trained_seqs=float(rows.sample_mask.sum()),
                                              global_valid_toks=float(valid_toks),
                                              global_valid_seqs=float(valid_seqs))
    return {**metrics, "skipped_zero_advantage_rows": float(batch.batch_size - len(trained))}


def select_rows(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    """The ``rows`` of every tensor of ``batch`` (a view when they are contiguous)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return batch.rows(rows[0], rows[0] + len(rows))
    return batch.select(rows)


def describe_rows(rows: list[int]) -> str:
    """``3..6`` for a contiguous run of rows, else the rows listed."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return f"{rows[0]}..{rows[-1]}"
    return ", ".join(map(str, rows))
