"""The optional protocols: one small protocol per optional method a component may have.

A component implements one of these or not; the loop and the runtimes ask with ``isinstance``
(never ``hasattr``), so the question and its answer are spelled out here once. On Ray the
driver-side proxies (``grpo_sdk.runtime.groups``) expose exactly the optional methods the remote
component has, so ``isinstance`` answers for a proxy as for the component it stands for.
Paths are ``str``, absolute. docs/plugins.md, "Optional protocols", lists which loop step calls
each one.

A module of its own beside ``grpo_sdk.core.protocols`` (the protocols every component of a kind
must satisfy), which re-exports every name here: plugins import them from there, or from
``grpo_sdk.plugins``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import random

    from torch import Tensor

    from grpo_sdk.core.records import (
        GenerationInput,
        GenerationOutput,
        SamplingParams,
        TrainBatch,
    )


@runtime_checkable
class Checkpointable(Protocol):
    """State beyond the weights that a checkpoint keeps, so that a resumed run does exactly what the
    original would have (a generation backend's sampling RNG). The ``Policy`` protocol requires both
    methods; for a generation backend they are optional.

    ``save_checkpoint(path)`` gets an absolute directory that may not exist yet (create it); it
    blocks until every file is written (the checkpoint is committed, atomically, right after it
    returns). ``load_checkpoint(path)`` gets a directory an earlier ``save_checkpoint`` wrote (it is
    called only when that directory exists) and blocks until the state is restored: the next call
    (``generate``) must already see it. A backend with several processes (replicas, ranks) writes
    and reads them all before returning.

    Example (the built-in ``hf`` generation backend)::

        class HFGeneration:
            def save_checkpoint(self, path: str) -> None:
                Path(path).mkdir(parents=True, exist_ok=True)
                save_file({"generator": self.generator.get_state()}, f"{path}/rng.safetensors")

            def load_checkpoint(self, path: str) -> None:
                self.generator.set_state(load_file(f"{path}/rng.safetensors")["generator"])

        isinstance(HFGeneration(config, context), Checkpointable)   # True
    """

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


@runtime_checkable
class PromptSampler(Protocol):
    """An environment that makes its own prompts (a synthetic task): with no ``data.train_path``
    the run draws training prompts from it, and validation prompts when ``data.validation_path`` is
    unset. Declare the ``generates_prompts`` capability too, so config checks know it without
    importing the class.

    ``sample_prompts(num_prompts, rng)`` returns ``num_prompts`` pairs ``(prompt text, metadata)``;
    the metadata reaches ``step`` with the sample. It must draw every random choice from ``rng``
    (a ``random.Random`` the run seeds and checkpoints), so that resumed runs and Ray runs (where
    it runs in the driver) see the same prompts. It blocks; keep it fast (it has the
    ``cluster.call_timeout_s`` deadline of an environment call).

    Example (the built-in ``reverse_digits`` task)::

        class ReverseDigitsEnvironment:
            def sample_prompts(self, num_prompts: int, rng: random.Random) -> list[tuple[str, dict]]:
                digits = ["".join(rng.choice("0123456789") for _ in range(5)) for _ in range(num_prompts)]
                return [(f"{d}>", {"target": d[::-1]}) for d in digits]

        env.sample_prompts(2, random.Random(0))   # [("49…>", {"target": "…94"}), ...]
    """

    def sample_prompts(self, num_prompts: int, rng: random.Random) -> Sequence[tuple[str, dict[str, Any]]]: ...


@runtime_checkable
class RunsOnMainThread(Protocol):
    """An environment whose ``step`` calls code that works only on a process's main thread:
    signal-based timeouts (math-verify's ``parse`` and ``verify`` bound themselves with
    ``signal.alarm``), signal handlers of its own. When the training loop runs on the main thread
    (the synchronous loop on the local runtime, ``grpoctl run`` and ``grpo_sdk.train``), the runtime
    calls such a ``step`` there instead of on a helper thread, and enforces ``cluster.call_timeout_s``
    by interrupting it (``runtime/deadlines.py``, ``call_on_main_thread``). ``runs_on_main_thread()``
    may depend on the config; False keeps the helper thread.

    Example (the built-in ``reward_functions`` environment)::

        class RewardFunctionsEnvironment:
            def runs_on_main_thread(self) -> bool:
                return True   # TRL-style functions call math-verify, as TRL calls them: on the main thread
    """

    def runs_on_main_thread(self) -> bool: ...


@runtime_checkable
class DeclaresRewardComponents(Protocol):
    """An environment's config block that knows, before anything is built, how many named reward
    components (``EnvironmentReturn.rewards`` keys) the environment will report. Config checks of
    components that consume the components (the ``gdpo`` estimator's one weight per component)
    compare against it, so a mismatch is a config error (exit 2) rather than a failure at step 1.

    Example (the built-in ``reverse_digits`` task's config)::

        @attrs.frozen(kw_only=True)
        class ReverseDigitsConfig:
            format_weight: float = option(0.0, "...")

            def num_reward_components(self) -> int:
                return 2 if self.format_weight > 0 else 1   # correct_digits (+ format)
    """

    def num_reward_components(self) -> int: ...


@runtime_checkable
class ReportsMetrics(Protocol):
    """An advantage estimator with metrics of its own: after each ``compute_advantages`` call the
    loop reads ``last_metrics`` (scalar name -> value) and logs it with the step's metrics. Set it
    in ``__init__`` (an empty dict) and replace it in every call; prefix the names with the
    estimator's name so they cannot collide with the loop's.

    Example (the built-in ``opd`` estimator)::

        class OPDEstimator:
            def __init__(self, config, context):
                self.last_metrics: dict[str, float] = {}

            def compute_advantages(self, batch):
                ...
                self.last_metrics = {"on_policy_distillation/adv_mean": float(adv.mean())}
                return adv
    """

    last_metrics: dict[str, float]


@runtime_checkable
class ExportsMergedModel(Protocol):
    """A policy *class* whose checkpoints may hold adapters only (LoRA: ``policy.lora``) and which can
    write such a checkpoint as a standalone Hugging Face model directory, the adapters folded into the
    base. ``grpoctl export`` (``grpo_sdk.export_model``) builds no policy: it finds the class of the run's
    ``policy.backend`` (in ``config.resolved.yaml``) and calls this on it, so make it a ``staticmethod``
    or ``classmethod``. A checkpoint that is a model directory already (every weight trained) is copied
    as it is, and ``--lora adapter`` copies the adapter directory: neither calls it.

    ``export_merged(policy_dir, out)`` gets the checkpoint's policy directory (what ``save_checkpoint``
    wrote) and ``out``, a directory that does not exist yet; it writes config, weights and the
    checkpoint's tokenizer files there, no optimizer state.

    Example (the built-in ``hf`` policy)::

        class HFPolicy:
            @staticmethod
            def export_merged(policy_dir: str, out: str) -> None:
                lora.export_merged(Path(policy_dir), Path(out))   # peft's merge_and_unload

        isinstance(HFPolicy, ExportsMergedModel)   # True: asked of the class
    """

    def export_merged(self, policy_dir: str, out: str) -> None: ...


@runtime_checkable
class WeightFileWriter(Protocol):
    """A policy that writes its own weights file, for the ``disk`` weight-sync transport (without it
    the transport writes ``policy.named_weights()`` itself, in the driver).

    ``save_weights(path)`` writes every ``named_weights`` pair to one safetensors file at ``path``
    (absolute; its directory exists), atomically (a reader never sees half a file: write a
    temporary name, then rename), and blocks until the file is complete. It returns
    ``(number of tensors, number of bytes)`` for ``SyncStats``. On Ray the policy worker group has
    it (rank 0 writes in its own process, the other ranks drain their ``named_weights``).

    Example::

        class MyPolicy:
            def save_weights(self, path: str) -> tuple[int, int]:
                tensors = {name: t.detach().cpu().contiguous() for name, t in self.named_weights()}
                save_file(tensors, path + ".tmp")
                os.replace(path + ".tmp", path)
                return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())
    """

    def save_weights(self, path: str) -> tuple[int, int]: ...


@runtime_checkable
class WeightFileLoader(Protocol):
    """A generation backend that loads a weights file itself, for the ``disk`` weight-sync
    transport: the natural path for an inference server that reads the file where it runs (without
    it the transport reads the file in the driver and calls ``update_weights``).

    ``load_weights(path, version=)`` gets the absolute path of a complete safetensors file (the
    names of the policy's ``named_weights``) and blocks until the new weights are in use: the next
    ``generate`` samples under them and reports ``weight_version == version``. The transport may
    delete the file as soon as the call returns. On Ray the generation worker group has it (each
    replica reads the file in its own process).

    Example (a client of an inference server)::

        class ServerGeneration:
            def load_weights(self, path: str, *, version: int) -> None:
                self.session.post(f"{self.url}/load_weights", json={"path": path}).raise_for_status()
                self.weight_version = version   # the server answered: the weights are loaded
    """

    def load_weights(self, path: str, *, version: int) -> None: ...


@runtime_checkable
class ReceivesBroadcast(Protocol):
    """A generation backend whose engine receives the ``collective`` transport's broadcasts in its
    own processes: it joins the transport's process group (policy rank 0 is rank 0) and each of its
    workers receives every tensor, as SGLang's ``init_weights_update_group`` /
    ``update_weights_from_distributed``, TensorRT-LLM's collective worker extension and Dynamo's
    refit routes do. Without it the transport receives in the generation worker and calls
    ``update_weights``. Declare the ``receives_broadcast`` capability with it.

    ``broadcast_ranks()`` is how many ranks the engine adds to the group (its tensor x pipeline
    parallel workers; 1 for one process). ``join_broadcast(...)`` makes the engine join the group
    (a torch.distributed rendezvous at ``tcp://master_address:master_port``, the engine's workers
    taking ranks ``rank_offset`` onward, the group named ``group_name``) and returns once it has;
    it is called at the first sync, while rank 0 joins. ``receive_broadcast(tensors, ...)`` tells
    the engine the ``(name, shape, dtype)`` of the next tensors, in order (dtype as torch spells it
    without the prefix: ``"bfloat16"``); rank 0 broadcasts each of them on its own, and the call
    returns once the engine has received and loaded them all. A sync is one or more such calls,
    the last with ``last=True``: then the engine finishes the update (drops cached KV, runs
    post-load processing) and ``generate`` reports ``weight_version == version``.

    Which kind of group the engine's workers build is the optional attribute ``broadcast_peer``:
    ``"torch"`` (the default: a torch process group built as SGLang's ``init_custom_process_group``
    builds it, ``grpo_sdk.plugins.toolkit.join_process_group``) or ``"vllm"`` (vLLM's
    ``StatelessProcessGroup`` + ``PyNcclCommunicator``, what vLLM's NCCL weight-transfer engine
    joins; rank 0 then needs vllm and CUDA). Rank 0 builds its end to match.

    Example (a client of an SGLang server)::

        class SGLangGeneration:
            def receive_broadcast(self, tensors, *, group_name, version, last):
                self.post("/update_weights_from_distributed", {
                    "names": [n for n, _, _ in tensors], "shapes": [list(s) for _, s, _ in tensors],
                    "dtypes": [d for _, _, d in tensors], "group_name": group_name, "flush_cache": last})
    """

    def broadcast_ranks(self) -> int: ...

    def join_broadcast(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str) -> None: ...

    def receive_broadcast(self, tensors: Sequence[tuple[str, tuple[int, ...], str]], *, group_name: str,
                          version: int, last: bool) -> None: ...


@runtime_checkable
class SurvivorNormalizedLoss(Protocol):
    """A loss whose gradient a policy must rescale after the last micro-batch of each optimizer step
    (the in-loss logprob-error filter of ``ClippedPGLoss``: which rows survive is known only after
    every micro-batch's forward pass). A policy backend that implements ``train`` honours it:

    Example (what the built-in ``hf`` policy does per optimizer step)::

        if isinstance(loss_fn, SurvivorNormalizedLoss) and loss_fn.requires_survivor_normalization:
            factor, (metrics,) = loss_fn.survivor_normalization(
                [metrics], global_valid_seqs=float(valid_seqs), global_valid_toks=float(valid_toks))
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(factor)          # before clipping and optimizer.step()

    ``survivor_normalization(micro_metrics, *, global_valid_seqs, global_valid_toks)`` takes the
    step's summed micro-batch metrics and the global counts the loss divided by, and returns the
    gradient factor and the metrics rescaled to the survivors. Pure arithmetic, no I/O.
    """

    @property
    def requires_survivor_normalization(self) -> bool: ...

    def survivor_normalization(self, micro_metrics: list[dict[str, float]], *, global_valid_seqs: float,
                               global_valid_toks: float) -> tuple[float, list[dict[str, float]]]: ...


@runtime_checkable
class ZeroGradientRows(Protocol):
    """A loss that can name the rows of a batch that contribute nothing to it: no loss, no gradient
    (``ClippedPGLoss`` without a KL term, an NLL term or the in-loss filter: a row whose advantages
    are all 0, a group whose samples all scored alike). A policy may leave them out of its forward and
    backward passes while still dividing by the whole global batch's counts: the gradient is the same
    up to float summation order. The loss's metrics then cover the rows trained on.

    Example (what the built-in ``hf`` policy does with ``policy.hf.skip_zero_advantage_rows``)::

        if isinstance(loss_fn, ZeroGradientRows):
            idle = loss_fn.zero_gradient_rows(batch)      # [B] bool, or None: every row counts
            ...                                           # forward/backward the other rows only
            metrics = loss_fn.metrics_of_trained_rows(metrics, trained_toks=..., trained_seqs=...,
                                                      global_valid_toks=..., global_valid_seqs=...)
    """

    def zero_gradient_rows(self, batch: TrainBatch) -> Tensor | None: ...

    def metrics_of_trained_rows(self, metrics: dict[str, float], *, trained_toks: float, trained_seqs: float,
                                global_valid_toks: float, global_valid_seqs: float) -> dict[str, float]: ...


@runtime_checkable
class PausesForRefit(Protocol):
    """A generation backend that can stop new starts for a weight update, without
    (``keep_in_flight=True``) or after (``False``) draining what is in flight. Async GRPO's
    collector calls it around every refit (docs/async.md); a backend declaring the
    ``in_flight_weight_updates`` capability must have it (the contract kit checks).

    ``pause_generation(keep_in_flight=False)`` returns once no generation is running (it waits
    for the running ``generate`` call); ``keep_in_flight=True`` returns at once, with the running
    requests still decoding: ``update_weights`` may then land between two of their decode steps.
    Until ``resume_generation``, a new ``generate`` call waits (bounded by a deadline, then a clear
    error). ``resume_generation(recompute_kv_cache=True)`` makes requests that were in flight across
    an update recompute their KV cache under the new weights before their next token (AReaL
    style); ``False`` lets them continue on the cache the old weights wrote (Magistral style).
    Either way each token's logprob stays that of the distribution it was sampled from, and
    ``GenerationOutput.token_weight_versions`` says which weights sampled it.

    Example (the refit of the async collector, in-flight)::

        generation.pause_generation(keep_in_flight=True)    # running requests keep decoding
        sync.sync_weights(policy, generation, version=7)    # lands between two decode steps
        generation.resume_generation(recompute_kv_cache=False)
        isinstance(HFGeneration(config, context), PausesForRefit)   # True
    """

    def pause_generation(self, *, keep_in_flight: bool) -> None: ...

    def resume_generation(self, *, recompute_kv_cache: bool) -> None: ...


@runtime_checkable
class AsyncGeneration(Protocol):
    """A generation backend that takes requests without blocking and hands back results as they
    finish (a continuous-batching engine), so async GRPO's ``newest`` schedule streams prompt groups
    instead of waiting for the slowest row of a batch (docs/async.md).

    ``submit(request_id, prompts, sampling)`` queues a request (``request_id`` unique among those
    not yet polled) and returns at once. ``poll(timeout_s)`` waits at most ``timeout_s`` seconds for
    at least one request to finish and returns every finished one as ``(request_id, output)``, or
    ``(request_id, exception)`` for a request that failed; ``[]`` when none finished in time.
    ``cancel(request_ids)`` drops requests that have not been returned yet (unknown ids are
    ignored); a cancelled request is never returned by ``poll``. ``update_weights`` and
    ``PausesForRefit`` apply to submitted requests as to a running ``generate``.

    Example::

        generation.submit("g17", GenerationInput(input_ids=ids, attention_mask=am),
                          SamplingParams(max_new_tokens=64))
        for request_id, result in generation.poll(timeout_s=0.25):
            if isinstance(result, BaseException):
                ...                                  # retry or report request_id
            else:
                result.response_ids, result.token_weight_versions
        generation.cancel(["g18"])                   # stopping: never returned
    """

    def submit(self, request_id: str, prompts: GenerationInput, sampling: SamplingParams) -> None: ...

    def poll(self, timeout_s: float) -> list[tuple[str, GenerationOutput | BaseException]]: ...

    def cancel(self, request_ids: Sequence[str]) -> None: ...


@runtime_checkable
class SupportsShutdown(Protocol):
    """A component that holds something to release when the run ends (a process pool, a server
    connection, a sandbox). ``Generation`` and ``Policy`` require it; for an environment, an
    estimator or a weight-sync transport it is optional. The run calls it once, newest component
    first, after the last step (also after a failure or an interrupt); it blocks until the
    resources are released and should not raise.

    Example (the built-in ``math`` environment)::

        class MathEnvironment:
            def shutdown(self) -> None:
                self._pool.shutdown(cancel_futures=True)
    """

    def shutdown(self) -> None: ...


OPTIONAL_PROTOCOLS: tuple[type, ...] = (Checkpointable, PromptSampler, ReportsMetrics, WeightFileWriter,
                                        WeightFileLoader, SurvivorNormalizedLoss, ZeroGradientRows,
                                        SupportsShutdown, PausesForRefit, AsyncGeneration, ReceivesBroadcast)
"""Every optional protocol above (the Ray workers report which of their methods a component has)."""


def protocol_methods(protocol: type) -> tuple[str, ...]:
    """The method names a protocol declares, in declaration order (``("save_checkpoint", "load_checkpoint")``)."""
    return tuple(name for name, value in vars(protocol).items()
                 if callable(value) and not name.startswith("_"))
