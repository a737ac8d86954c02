"""Policy machinery for plugin authors: what the built-in hf and megatron policies train with.

Public, like ``grpo_sdk.plugins`` (docs/compatibility.md): the names in ``__all__``. Importing this
module imports torch: import it from a policy's implementation module, never from its spec.

* The optimizer: ``make_optimizer(params, config)`` is AdamW over ``params`` from
  ``policy.optimizer`` (``moments_dtype: bfloat16`` keeps the moments in bfloat16, rounded
  stochastically) with the LR schedule of ``policy.scheduler`` (warmup, then constant, linear or
  cosine down to ``min_lr_ratio``; it counts optimizer steps), as ``(optimizer, scheduler)``;
  ``lr_lambda`` is that schedule's multiplier of the peak lr.
* The training loop: ``train_global_batches(policy, batch, loss_fn, logprobs=...)`` is a whole
  ``Policy.train``: global batches of ``policy.train_global_batch_size`` rows (one optimizer step
  each) of micro-batches whose gradients accumulate, the loss normalised by the counts of the whole
  global batch, the survivor normalisation of a ``SurvivorNormalizedLoss``, clipping to
  ``policy.max_grad_norm``, a ``NonFiniteError`` naming the step and rows. A backend passes what
  differs: its logprobs, its data-parallel share and reduction, token-budget micro-batches, the
  norm of a sharded model. ``TrainsGlobalBatches`` lists the attributes it reads;
  ``clip_gradients``, ``select_rows`` and ``describe_rows`` are its pieces.
* Data parallelism: ``row_share(rows, what)`` (this rank's equal, contiguous share; an uneven split
  is an error naming the keys), ``all_gather_rows``, ``all_reduce_metrics`` (a step's metrics over
  the ranks: sums add, ``_min``/``_max`` take the extreme), ``any_rank``, ``max_over_ranks`` and
  ``broadcast_json`` (JSON from rank 0, no pickle).

Example (a policy backend's ``train``)::

    from grpo_sdk.plugins.training import make_optimizer, train_global_batches

    class MyPolicy:
        def __init__(self, config, context):
            ...
            self.optimizer, self.scheduler = make_optimizer(self.params, context.config)
            self.optimizer_steps = 0

        def train(self, batch, loss_fn):
            return train_global_batches(self, batch, loss_fn, logprobs=self.micro_logprobs)
"""

from __future__ import annotations

from grpo_sdk.algorithms.global_batches import (
    TrainsGlobalBatches,
    clip_gradients,
    describe_rows,
    select_rows,
    train_global_batches,
)
from grpo_sdk.algorithms.optimizer import lr_lambda, make_optimizer
from grpo_sdk.core.data_parallel import (
    all_gather_rows,
    all_reduce_metrics,
    any_rank,
    broadcast_json,
    max_over_ranks,
    row_share,
)

__all__ = [
    "TrainsGlobalBatches",
    "all_gather_rows",
    "all_reduce_metrics",
    "any_rank",
    "broadcast_json",
    "clip_gradients",
    "describe_rows",
    "lr_lambda",
    "make_optimizer",
    "max_over_ranks",
    "row_share",
    "select_rows",
    "train_global_batches",
]
