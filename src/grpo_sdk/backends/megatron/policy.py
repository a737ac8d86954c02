"""megatron policy: a Megatron-Core ``GPTModel`` built from a Hugging Face model directory by mbridge.

It mirrors ``grpo_sdk.backends.hf.policy`` step for step: the same logprobs (temperature / top-k /
top-p as the sampler applies them), a frozen reference copy only when the run needs one, ``train``
as the hf policy's, ``grpo_sdk.plugins.training.train_global_batches`` (global batches of
micro-batches, the global token / sequence normalisation, clipping with ``policy.max_grad_norm``) with
the same optimizer and LR schedule (``make_optimizer``), and weights exported in Hugging Face names
through the bridge.

Parallelism (``policy.megatron``): tensor parallelism (TP) splits heads, MLP columns and the
vocabulary; logprobs come from the vocab shards without gathering them (``parallel``). With
``context.world_size > 1`` the runtime's process group is used: DP = world / TP replicas, each taking
its share of every batch's rows, gradients summed over the data-parallel group. Pipeline, context and
expert parallelism and sequence parallelism are refused with the key and the reason. As with the hf
policy, every rank gets the same full batch in every call and calls every method (collectives), and
results come back whole and identical on every rank.

Optimizer: torch's AdamW over this rank's parameters (its TP shard); a TP-split parameter's gradient
is complete on its rank (Megatron's column/row-parallel layers all-reduce activations' gradients),
so only the gradient norm needs the TP group. Megatron's own optimizer (``get_megatron_optimizer``)
would need ``OptimizerConfig(clip_grad=0.0)`` on CPU (megatron/core/optimizer/clip_grads.py:167
asserts ``torch.cuda.FloatTensor`` gradients).

On a machine without CUDA the test-only CPU shims (``cpu_shims``) are applied; without Transformer
Engine the model is built with Megatron-Core's local layer spec (``bridging.adapt_bridge``).

Checkpoints are Hugging Face model directories (plus per-TP-shard optimizer files), so a megatron run's
checkpoint exports, serves and trains with the hf backends unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from grpo_sdk.backends.megatron import colocated, parallel
from grpo_sdk.backends.megatron.config import NOT_BUILT
from grpo_sdk.backends.megatron.bridging import adapt_bridge, transformers5_compat  # noqa: F401 (re-exported)
from grpo_sdk.backends.megatron.hf_semantics import freeze_padding_row
from grpo_sdk.backends.megatron.parallel import vocab_parallel_token_logprobs
from grpo_sdk.plugins import LossFunction, RunContext, TrainBatch
from grpo_sdk.plugins.tensors import DTYPES, position_ids_for
from grpo_sdk.plugins.toolkit import free_port
from grpo_sdk.plugins.training import (all_gather_rows, all_reduce_metrics, any_rank, make_optimizer,
                                       train_global_batches)

# "optimizer.*": grpoctl export leaves these out of an exported model directory (trainer.checkpoint).
CHECKPOINT_FILE = "optimizer.pt"

__all__ = ["MegatronPolicy", "checkpoint_file", "check_parallel_sizes", "vocab_parallel_token_logprobs"]


def checkpoint_file(tp_rank: int, tp_size: int) -> str:
    """``optimizer.pt`` with TP = 1; ``optimizer.tp{r}.pt`` per tensor-parallel shard."""
    return CHECKPOINT_FILE if tp_size == 1 else f"optimizer.tp{tp_rank}.pt"


def _size(config: Any, name: str, default: Any) -> Any:
    return default if config is None else getattr(config, name, default)


def check_parallel_sizes(config: Any, world_size: int) -> tuple[int, int]:
    """``(tp, dp)``: the parallelism this policy runs, or NotImplementedError/ValueError naming the key."""
    key = "policy.megatron"
    tp = _size(config, "tensor_model_parallel_size", 1)
    for name in ("pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size"):
        if _size(config, name, 1) != 1:
            raise NotImplementedError(f"{key}.{name}={_size(config, name, 1)}: not supported by the megatron "
                                      f"policy yet (only 1): {NOT_BUILT[name]}")
    if _size(config, "sequence_parallel", False):
        raise NotImplementedError(f"{key}.sequence_parallel=true: not supported by the megatron policy yet: "
                                  f"{NOT_BUILT['sequence_parallel']}")
    if world_size % tp:
        raise ValueError(f"{key}.tensor_model_parallel_size={tp} must divide the policy's world size "
                         f"({world_size}, cluster.policy_workers)")
    return tp, world_size // tp


def init_parallel_state(config: Any, context: RunContext) -> None:
    """Megatron's model-parallel state over the runtime's process group (a gloo group of one is made
    here when a single-process run has none)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if context.world_size > 1:
        if not dist.is_initialized():
            raise RuntimeError(f"megatron policy with world_size={context.world_size}: torch.distributed is not "
                               "initialised; the runtime must call torch.distributed.init_process_group before "
                               "building the policy")
        if (dist.get_rank(), dist.get_world_size()) != (context.rank, context.world_size):
            raise RuntimeError(f"megatron policy: the context says rank {context.rank} of {context.world_size}, "
                               f"but torch.distributed says rank {dist.get_rank()} of {dist.get_world_size()}")
    elif not dist.is_initialized():
        # An init_method rather than MASTER_ADDR/PORT in os.environ: those would leak into subprocesses
        # this one starts, whose own process groups would then fail with EADDRINUSE.
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    tp = _size(config, "tensor_model_parallel_size", 1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
        if torch.cuda.is_available():
            # Megatron's tensor-parallel RNG tracker ("model-parallel-rng") must be seeded before any
            # model is built on CUDA (on CPU the shims stand in for it).
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(context.seed)
    elif parallel_state.get_tensor_model_parallel_world_size() != tp:
        raise RuntimeError(f"Megatron's model-parallel state is already initialised with TP = "
                           f"{parallel_state.get_tensor_model_parallel_world_size()} in this process; "
                           f"policy.megatron.tensor_model_parallel_size is {tp}")


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean ``[B, 1, S, S]`` attention mask (True = masked): causal and key padding."""
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).triu(1)
    return (causal[None] | (attention_mask[:, None, :] == 0))[:, None]


class MegatronPolicy:
    def __init__(self, config: Any, context: RunContext):
        cfg = context.config
        self.config = config
        self.policy_cfg = cfg.policy
        self.device = torch.device(context.device)
        self.rank = context.rank
        self.tp, self.dp = check_parallel_sizes(config, context.world_size)
        self.cpu = not torch.cuda.is_available()
        if self.cpu:
            from grpo_sdk.backends.megatron import cpu_shims

            # Process-wide and left applied: other policies of this process share them.
            cpu_shims.apply()
        init_parallel_state(config, context)

        from megatron.core import parallel_state
        from mbridge import AutoBridge

        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel.dp_group() if self.dp > 1 else None
        dtype = DTYPES[cfg.policy.precision]
        self.model_path = context.model_path
        vocab = AutoBridge.from_pretrained(context.model_path, dtype=dtype).hf_config.vocab_size
        # Megatron's VocabParallelEmbedding needs the vocabulary to split evenly over TP: pad it to a
        # multiple of TP (mbridge zero-fills the extra rows on load and drops them on export); the
        # logprobs mask those columns.
        self.bridge = AutoBridge.from_pretrained(context.model_path, dtype=dtype,
                                                 make_vocab_size_divisible_by=self.tp if vocab % self.tp else None)
        adapt_bridge(self.bridge)
        self.vocab_size = self.bridge.hf_config.vocab_size
        self._apply_model_options()
        self.models = self._build()
        (self.model,) = self.models
        self.reference = None
        if context.needs_reference:
            # A second build from the same weights (an mcore model holds process groups and does
            # not deepcopy).
            (self.reference,) = self._build()
            self.reference.requires_grad_(False)

        gen = cfg.policy.generation
        self.sampling = {"temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p}
        filtered = bool(gen.top_k) or gen.top_p < 1.0
        self.kl_needs_unfiltered = filtered and cfg.loss_fn.reference_policy_kl_penalty > 0
        freeze_padding_row(self.model, self.bridge.hf_config.pad_token_id)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, cfg)
        self.optimizer_steps = 0
        self.save_optimizer = cfg.checkpointing.save_optimizer
        # A colocated megatron generation of this process generates on this very model (colocated.py).
        colocated.publish_policy(context, self)

    def _apply_model_options(self) -> None:
        """``policy.megatron`` keys that shape the mcore TransformerConfig mbridge builds from.

        ``use_distributed_optimizer`` is a no-op with one data-parallel replica (torch AdamW here) and
        refused with more; ``checkpoint_format`` has only "torch"; ``sequence_parallel`` is refused by
        ``check_parallel_sizes``.
        """
        if self.dp > 1 and _size(self.config, "use_distributed_optimizer", False):
            raise NotImplementedError("policy.megatron.use_distributed_optimizer=true with data parallelism: not "
                                      f"built yet: {NOT_BUILT['use_distributed_optimizer']}")
        tconfig = self.bridge.config
        # mbridge turns it on whenever TP > 1 (core/llm_bridge.py); this policy runs without it.
        tconfig.sequence_parallel = False
        # No dropout, as the hf policy (eval mode): the sampler's, the old policy's and the training
        # logprobs agree for identical weights.
        tconfig.hidden_dropout = tconfig.attention_dropout = 0.0
        tconfig.apply_rope_fusion = bool(_size(self.config, "apply_rope_fusion", False))
        tconfig.bias_activation_fusion = bool(_size(self.config, "bias_activation_fusion", False))
        if _size(self.config, "activation_checkpointing", False):
            # On CPU, megatron's CheckpointFunction saves the CUDA RNG state: cpu_shims W5 covers it.
            # Full recompute of every layer in backward (megatron's recompute_granularity="full").
            tconfig.recompute_granularity = "full"
            tconfig.recompute_method = "uniform"
            tconfig.recompute_num_layers = 1

    def _build(self) -> list:
        precision = self.policy_cfg.precision
        models = self.bridge.get_model(bf16=precision == "bfloat16", fp16=precision == "float16",
                                       use_cpu_initialization=self.cpu, wrap_with_ddp=False)
        self.bridge.load_weights(models, self.model_path)
        for model in models:
            # No dropout: the sampler's, the old policy's and the training logprobs agree (as hf).
            model.to(self.device).eval()
        return models

    # --- logprobs -------------------------------------------------------------------------------

    def _sequence_logprobs(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           with_unfiltered: bool = False):
        """Input-aligned ``[B, S]`` float32 logprobs (column 0 and padding are 0), as hf's.

        Megatron-Core's GPTModel computes RoPE from the sequence length and ignores ``position_ids``
        (they only feed learned absolute embeddings), so a left-padded row would see shifted
        positions. Each row is therefore rolled left by its leading padding (its tokens then sit at
        positions 0.., as ``position_ids_for`` gives the hf model) and the logprobs rolled back. This
        assumes each row's tokens are one contiguous block (left-padded prompt + right-padded
        response, as the loop builds them). The first token of a row has no context: its logprob is 0.
        """
        seq = input_ids.shape[1]
        lead = (attention_mask.cumsum(-1) == 0).sum(-1)  # leading padding per row
        cols = torch.arange(seq, device=input_ids.device)
        rolled_index = (cols[None] + lead[:, None]) % seq
        ids = input_ids.gather(1, rolled_index)
        mask = attention_mask.gather(1, rolled_index)
        logits = model(input_ids=ids, position_ids=position_ids_for(mask),
                       attention_mask=causal_padding_mask(mask))
        logits, targets = logits[:, :-1], ids[:, 1:]
        keep = mask[:, 1:].bool() & mask[:, :-1].bool()
        back_index = (cols[None] - lead[:, None]) % seq

        def aligned(**sampling):
            lp = vocab_parallel_token_logprobs(logits, targets, vocab_size=self.vocab_size, **sampling)
            lp = torch.nn.functional.pad(torch.where(keep, lp, torch.zeros_like(lp)), (1, 0))
            return lp.gather(1, back_index)

        logprobs = aligned(**self.sampling)
        if not with_unfiltered:
            return logprobs
        return logprobs, aligned(temperature=self.sampling["temperature"])

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        if self.dp > 1:  # this replica's equal share (its TP ranks take the same one)
            batch = batch.rows(*parallel.dp_row_share(batch.batch_size, "policy logprobs"))
        size = self.policy_cfg.logprob_batch_size
        chunks = [self._sequence_logprobs(model, batch.input_ids[i:i + size].to(self.device),
                                          batch.attention_mask[i:i + size].to(self.device))
                  for i in range(0, batch.batch_size, size)]
        logprobs = torch.cat(chunks)
        return (all_gather_rows(logprobs, self.dp_group) if self.dp > 1 else logprobs).cpu()

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._logprobs(self.model, batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("reference_logprobs needs loss_fn.reference_policy_kl_penalty > 0")
        return self._logprobs(self.reference, batch)

    # --- training -------------------------------------------------------------------------------

    def train(self, batch: TrainBatch, loss_fn: LossFunction) -> dict[str, float]:
        # Training mode only for megatron's activation recompute, which runs only when training;
        # dropout is 0 (from the HF config), so the logprobs are those of eval mode.
        self.model.train()
        try:
            return train_global_batches(
                self, batch, loss_fn, logprobs=self._micro_logprobs,
                row_share=parallel.dp_row_share if self.dp > 1 else None,
                reduce=self._reduce if self.dp > 1 else None,
                # The norm of the whole model from its TP shards, the same on every rank.
                clip=parallel.clip_grad_norm if self.tp > 1 else None)
        finally:
            self.model.eval()

    def _micro_logprobs(self, micro: TrainBatch, *, with_unfiltered: bool):
        return self._sequence_logprobs(self.model, micro.input_ids, micro.attention_mask,
                                       with_unfiltered=with_unfiltered)

    def _reduce(self, metrics: dict[str, float], failed: bool) -> tuple[dict[str, float], bool]:
        """The whole global batch's metrics and gradient, identical on every replica."""
        metrics, failed = all_reduce_metrics(metrics, failed, self.device, self.dp_group, who="megatron policy")
        if not failed:
            parallel.all_reduce_gradients(self.params, self.dp_group)
        return metrics, failed

    # --- weights and state ----------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors in Hugging Face names (mbridge's export: fused QKV / gate-up split back, TP
        shards gathered over the TP group, vocab padding dropped). With TP > 1 every rank must drain it.

        Each step of the export runs without autograd: it broadcasts parameters in place over the
        pipeline group, which with grad mode on lands in the next backward's graph (torch warns
        "c10d::broadcast_: an autograd kernel was not registered"). Only the export's own steps: a
        ``no_grad`` around the ``yield`` would leak into the consumer's code.
        """
        export = self.bridge.export_weights(self.models)
        while True:
            with torch.no_grad():
                item = next(export, None)
            if item is None:
                return
            yield item

    def save_checkpoint(self, path: str) -> None:
        """``path`` becomes a Hugging Face model directory (config.json + safetensors, mbridge's export,
        written by rank 0), so ``grpoctl export``/``serve`` and the hf backends read it as they read the
        hf policy's; next to it one torch file per tensor-parallel shard (``checkpoint_file``) with that
        shard's optimizer, LR schedule, step count and the writing rank's RNG state.

        Every rank calls it (the export gathers TP shards). Data-parallel replicas hold the same shard,
        so only data-parallel rank 0 of each TP group writes its file; every rank returns once all files
        are written (or raises on every rank when one failed).
        """
        directory = Path(path)
        error = None
        try:
            with torch.no_grad():
                self.bridge.save_weights(self.models, str(directory))
        except Exception as exc:  # noqa: BLE001 - shared below
            error = exc
        if self.dp_rank == 0 and error is None:
            try:
                state = {"optimizer_steps": self.optimizer_steps, "rng": _rng_state(),
                         "tensor_model_parallel_size": self.tp}
                if self.save_optimizer:
                    state["optimizer"] = self.optimizer.state_dict()
                    state["scheduler"] = self.scheduler.state_dict()
                torch.save(state, directory / checkpoint_file(self.tp_rank, self.tp))
            except Exception as exc:  # shared below, so that no rank waits for a rank that failed
                error = exc
        if self.dp * self.tp > 1 and any_rank(error is not None, self.device):
            raise error or RuntimeError(f"another policy rank could not write its part of the checkpoint {path}")
        if error is not None:
            raise error

    def load_checkpoint(self, path: str) -> None:
        """The weights from the checkpoint's Hugging Face files (mbridge splits them into this rank's
        shard: exact, as the export is), then this TP shard's optimizer file (a checkpoint saved with
        another TP size is refused: the optimizer state is sharded like the parameters)."""
        file = Path(path) / checkpoint_file(self.tp_rank, self.tp)
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no checkpoint for tensor-parallel rank {self.tp_rank} of {self.tp} "
                                    "(was it saved with another policy.megatron.tensor_model_parallel_size?)")
        state = torch.load(file, map_location=self.device, weights_only=True)
        saved_tp = state.get("tensor_model_parallel_size", 1)
        if saved_tp != self.tp:
            raise RuntimeError(f"checkpoint {path} was saved with tensor_model_parallel_size={saved_tp}, this "
                               f"policy runs {self.tp}")
        with torch.no_grad():
            self.bridge.load_weights(self.models, str(path))
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = state["optimizer_steps"]
        _set_rng_state(state["rng"])

    def offload(self) -> None:
        self.model.to("cpu")

    def onload(self) -> None:
        self.model.to(self.device)

    def shutdown(self) -> None:
        self.models = self.model = self.reference = None
        self.optimizer = None


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
