"""The five protocols the training loop talks to, plus the loss and logger callables.

The loop never asks which backend it drives: it calls these methods and nothing else. Every
implementation is constructed the same way, ``Impl(config, context)``: ``config`` is the
component's own structured config block (an instance of its spec's ``config`` class, or None)
and ``context`` is the ``RunContext`` of the run (resolved config, run directory, model path,
seed). See ``grpo_sdk.config.context``.

Tensors follow the conventions of ``grpo_sdk.core.records``: input-aligned ``[B, S]``.

The optional protocols (``Checkpointable``, ``PausesForRefit``, ...) are defined in
``grpo_sdk.core.optional_protocols`` and importable from here as well; the worker-group API that
weight-sync transports use (``Worker``, ``WorkerGroup``) closes this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, Sequence, runtime_checkable

# The optional protocols live in grpo_sdk.core.optional_protocols; plugins import them from here (or
# from grpo_sdk.plugins), as before the split.
from grpo_sdk.core.optional_protocols import (  # noqa: F401 - re-exported
    OPTIONAL_PROTOCOLS,
    AsyncGeneration,
    Checkpointable,
    DeclaresRewardComponents,
    ExportsMergedModel,
    PausesForRefit,
    PromptSampler,
    ReceivesBroadcast,
    ReportsMetrics,
    RunsOnMainThread,
    SupportsShutdown,
    SurvivorNormalizedLoss,
    WeightFileLoader,
    WeightFileWriter,
    ZeroGradientRows,
    protocol_methods,
)

if TYPE_CHECKING:
    from torch import Tensor

    from grpo_sdk.core.records import (
        AdvantageInput,
        EnvironmentReturn,
        GenerationInput,
        GenerationOutput,
        MessageLog,
        SamplingParams,
        SyncStats,
        TrainBatch,
    )


@runtime_checkable
class Generation(Protocol):
    """Samples responses with per-token logprobs, and takes new weights from the policy.

    Example (the built-in ``hf`` backend)::

        gen = HFGeneration(HFGenerationConfig(), context)
        gen.prepare_for_generation()
        out = gen.generate(GenerationInput(input_ids=ids, attention_mask=am),
                           SamplingParams(max_new_tokens=5, temperature=1.0))
        gen.finish_generation()
        out.response_ids.shape     # [B, <=5]
        out.logprobs[0, :3]        # logprobs of the first three sampled tokens of row 0
        gen.update_weights(policy.named_weights(), version=1)
    """

    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        """Sample one response per row; stop each row at EOS (or a stop token) or max_new_tokens."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """Load new weights (names as in the policy's ``named_weights``) without a restart."""
        ...

    def prepare_for_generation(self) -> None:
        """Wake up (onload weights and caches) before a round of generation."""
        ...

    def finish_generation(self) -> None:
        """Release what a colocated policy needs for training (sleep, free the KV cache)."""
        ...

    def shutdown(self) -> None: ...

    # Optional: ``Checkpointable`` (state beyond the weights, such as the sampling RNG, so that a
    # resumed run samples exactly what the original would have), ``WeightFileLoader`` (load a
    # weights file the ``disk`` transport wrote), and for async GRPO ``PausesForRefit`` (weight
    # updates while requests are in flight) and ``AsyncGeneration`` (submit and poll), all below.


@runtime_checkable
class Policy(Protocol):
    """The trained model: logprobs, reference logprobs, optimizer steps, checkpoints.

    Example::

        policy = HFPolicy(HFPolicyConfig(), context)
        batch.prev_logprobs = policy.logprobs(batch)          # [B, S], column 0 is 0
        metrics = policy.train(batch, ClippedPGLoss(loss_cfg))
        metrics["loss"], metrics["grad_norm"]
        for name, tensor in policy.named_weights(): ...       # what weight sync sends
    """

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """Input-aligned logprobs of ``batch.input_ids`` under the current weights (no grad).

        Only the columns ``token_mask`` marks (the response tokens) are read; a policy may leave
        the others 0 (the hf policy computes nothing there)."""
        ...

    def reference_logprobs(self, batch: TrainBatch) -> Tensor:
        """The same under the frozen reference policy (the initial weights)."""
        ...

    def train(self, batch: TrainBatch, loss_fn: LossFunction) -> dict[str, float]:
        """Optimizer step(s) on ``batch``; the loss is normalised over the whole global batch."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The weights to send to generation, as (name, tensor) pairs."""
        ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def offload(self) -> None:
        """Move training state off the accelerator (colocated generation needs the memory)."""
        ...

    def onload(self) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class Environment(Protocol):
    """Scores (and, multi-turn, answers) a batch of conversations.

    Example (the built-in ``reverse_digits`` task)::

        env = ReverseDigitsEnvironment(ReverseDigitsConfig(), context)
        log = [Message(role="user", content="12345>"), Message(role="assistant", content="54321")]
        ret = env.step([log], [{"target": "54321"}])
        ret.rewards        # {"correct_digits": [1.0]}
        ret.metrics        # {"exact_match": 1.0}

    Environments that also make their own prompts (synthetic tasks) implement ``PromptSampler``
    (below); the loop uses it when no dataset is configured. One that holds resources implements
    ``SupportsShutdown``.

    ``step`` may be ``async def`` (an LLM judge, a remote sandbox): it is awaited on one event loop
    of the process, the calls of ``env.max_concurrent_calls`` groups at once interleaving there, and
    a call past ``cluster.call_timeout_s`` is cancelled.
    """

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        ...


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Turns rewards into per-token advantages. Pure torch, no I/O.

    ``batch`` is an ``AdvantageInput`` (``grpo_sdk.core.records``): ``rewards`` ``[B]``,
    ``group_ids`` ``[B]`` (rows of one prompt share an id), ``mask`` ``[B, S]`` (token mask times
    sample mask), and what some estimators need: ``reward_components``, ``valid_mask``, the
    logprob tensors, ``metadata``. Returns ``[B, S]`` advantages.

    Plugin API 1's form, ``compute_advantages(rewards, group_ids, mask, **extras)``, still works
    (docs/compatibility.md): the registry adapts such an estimator with a DeprecationWarning.

    Example::

        est = GRPOEstimator(GRPOEstimatorConfig(use_leave_one_out_baseline=False), context)
        est.compute_advantages(AdvantageInput(rewards=torch.tensor([2., 2., 1., 3.]),
                                              group_ids=torch.tensor([0, 0, 1, 1]), mask=torch.ones(4, 3)))
        # rows: [0, 0, 0], [0, 0, 0], [-0.7071]*3, [0.7071]*3
    """

    def compute_advantages(self, batch: AdvantageInput) -> Tensor:
        ...


@runtime_checkable
class WeightSync(Protocol):
    """Moves the policy's weights into the generation backend and bumps the weight version.

    Example::

        sync = InProcessWeightSync(None, context)
        stats = sync.sync_weights(policy, generation, version=3)
        stats.num_bytes, stats.seconds
    """

    def sync_weights(self, policy: Policy, generation: Generation, *, version: int) -> SyncStats:
        ...


class LossFunction(Protocol):
    """A loss over one micro-batch, normalised by counts over the whole global batch.

    ``logprobs`` are the current input-aligned logprobs of the micro-batch (with grad).
    Dividing by the *global* token and sequence counts makes the summed micro-batch gradients
    equal to the full-batch gradient, whatever the micro-batch size. Metrics come back already
    divided the same way, so a policy sums them over micro-batches (``_min``/``_max`` keys take
    the min/max: ``grpo_sdk.core.metrics``).

    Optional, for policy backends to honour: ``unfiltered_logprobs=`` (logprobs without
    top-k/top-p, for the KL term), ``SurvivorNormalizedLoss`` (below: the in-loss logprob-error
    filter's gradient rescale, after the last micro-batch of an optimizer step) and
    ``ZeroGradientRows`` (below: rows a policy need not run).
    """

    def __call__(self, logprobs: Tensor, batch: TrainBatch, *, global_valid_seqs: Tensor,
                 global_valid_toks: Tensor) -> tuple[Tensor, dict[str, float]]:
        ...


@runtime_checkable
class Logger(Protocol):
    """A sink for per-step scalar metrics (``grpo_sdk.loggers``)."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


# === The worker-group API weight-sync transports use (Ray runtime) =================================
#
# A transport that moves weights between processes (``collective``, ``cuda_ipc``) runs its own code
# next to the components: ``group.submit(fn, *args)`` starts ``fn(worker, *args)`` in every worker of
# a group, ``group.wait(calls)`` gathers them under one deadline. The Ray runtime's ``PolicyGroup`` and
# ``GenerationGroup`` implement ``WorkerGroup``; what ``fn`` receives implements ``Worker``. In one
# process the policy and generation are the components themselves, which have no ``submit``: a
# transport checks ``isinstance(policy, WorkerGroup)`` and says which runtime it needs.


@runtime_checkable
class Worker(Protocol):
    """What a worker operation ``fn(worker, *args)`` receives, in the worker's own process.

    ``component`` is the policy or generation backend built there; ``rank`` / ``world_size`` its
    place in the group (policy ranks share a torch.distributed group; generation replicas are
    independent, ``world_size`` 1); ``device`` is ``"cpu"`` or ``"cuda"``; ``state`` is a dict the
    transport may keep things in between calls (a process group, a plan), under its own key.

    Example (a worker operation: a module-level function, so Ray pickles it by reference)::

        def weight_count_op(worker: Worker) -> int:
            return sum(1 for _ in worker.component.named_weights())
    """

    component: Any
    rank: int
    world_size: int
    device: str
    state: dict[str, Any]

    def store_address(self) -> tuple[str, int]:
        """``(host, port)`` of a TCPStore this worker will serve: a socket listening on its node's
        address only, kept open until ``grpo_sdk.plugins.toolkit.tcp_store(worker, host, port,
        is_master=True, ...)`` takes it. Returns at once."""
        ...


@runtime_checkable
class WorkerGroup(Protocol):
    """The workers of one component (the policy's ranks, or the generation replicas).

    ``workers`` holds one handle per rank or replica, in order (``len(group.workers)``); a handle's
    ``label`` names it in messages (``"generation worker 1 (pid 4242)"``). ``submit`` returns at
    once; ``wait`` blocks until every call has ended and returns their results in order, or raises:
    a missed deadline (``timeout``, named in the error by ``deadline_key``) stops the stuck workers;
    ``on_app_error="wait"`` lets the other calls finish when one raises (a transport whose calls
    take part in one broadcast), ``"kill"`` stops them. ``wait`` may gather calls of several groups.

    Example (the driver side of a broadcast: both sides in flight together, one deadline)::

        calls = (policy.submit(send_op, group_id, name="send")
                 + generation.submit(receive_op, group_id, version, name="receive"))
        results = policy.wait(calls, timeout=600.0, on_app_error="wait")
        num_tensors, num_bytes = results[0]          # policy rank 0's answer
    """

    workers: Sequence[Any]

    def submit(self, fn: Any, *args: Any, ranks: Sequence[int] | None = None, name: str | None = None,
               **kwargs: Any) -> list[Any]:
        """Start ``fn(worker, *args, **kwargs)`` on the workers ``ranks`` (default all); the calls."""
        ...

    def run(self, fn: Any, *args: Any, ranks: Sequence[int] | None = None, timeout: float | None = None,
            name: str | None = None, **kwargs: Any) -> list[Any]:
        """``wait(submit(...))``: the results, in order."""
        ...

    def wait(self, calls: Sequence[Any], *, timeout: float | None = None, on_app_error: str | None = None,
             deadline_key: str | None = None) -> list[Any]:
        """Gather ``calls`` within ``timeout`` seconds (default ``cluster.call_timeout_s``)."""
        ...

# === end of the worker-group API ======================================================================
