"""Data parallelism for the hf policy: FSDP2 over the ranks of a worker group.

The contract with the runtime (``grpo_sdk.runtime``): it has already called
``torch.distributed.init_process_group`` (gloo on CPU, nccl on GPU, one GPU per rank) before the
policy is built; every rank is built with the same config and model, gets the SAME full batch in
every call, and calls every method (``named_weights`` drained to the end, ``save_checkpoint``
and ``load_checkpoint`` included), because each of them runs collectives. Each rank computes
its contiguous share of the rows; results come back whole and identical on every rank. The
rows of a call, and of each global batch, must split evenly over the ranks (equal shares keep
the ranks' forward/backward calls, and so FSDP's collectives, in step); ``train_micro_batch_size``
and ``logprob_batch_size`` count rows per rank. Checkpoints: rank 0 writes the single-process
files and is the only rank that reads them; the others receive their shards from it. The row
shares and collectives any data-parallel policy needs are ``grpo_sdk.plugins.training``'s; this
module has FSDP's part.

Which modules are sharded: every module whose class is named in the model's
``_no_split_modules`` (Hugging Face's own list of the decoder-layer classes: ``GPT2Block``,
``LlamaDecoderLayer``, ``Qwen2DecoderLayer``...); failing that, every child of the largest
``nn.ModuleList`` (the layer stack: ``model.layers``, ``transformer.h``). Then the root, which
keeps embeddings, final norm and LM head (and so tied embeddings) in one unit.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn


def check_process_group(rank: int, world_size: int) -> None:
    """The runtime must have joined this process to a group that matches the context."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"hf policy with world_size={world_size}: torch.distributed is not initialised; the "
                           "runtime must call torch.distributed.init_process_group before building the policy")
    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise RuntimeError(f"hf policy: the context says rank {rank} of {world_size}, but torch.distributed says "
                           f"rank {dist.get_rank()} of {dist.get_world_size()}")


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one (see the module docstring for the rule)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not blocks:
        stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        blocks = list(max(stacks, key=len)) if stacks else []
    return blocks


def shard(model: nn.Module, mesh) -> None:
    """FSDP2 over ``mesh``: each block, then the root; gradients are summed, not averaged, over ranks.

    Each rank's loss is already divided by the counts of the WHOLE global batch, so the
    single-process gradient is the SUM of the ranks' gradients. FSDP2 averages by default;
    a divide factor of 1 with sum-only reductions makes its reduce-scatter a plain SUM (no
    PREMUL_SUM, which gloo lacks, and no extra multiply). Scaling the loss by world_size instead
    would leave FSDP's division in place and round for world sizes that are not powers of two.
    """
    # Imported here: a single-process policy never loads FSDP. Public from torch 2.6; 2.4/2.5 spelling too.
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard

    # Reversed pre-order: a block nested in another block is sharded first, as FSDP2 requires.
    blocks = set(map(id, decoder_blocks(model)))
    for module in reversed(list(model.modules())):
        if id(module) in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
            else:  # pragma: no cover - torch < 2.7: the divide factor was only for the reduce-scatter
                module.set_reduce_scatter_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is returned as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective); a plain tensor is returned as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def full_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.state_dict()`` with each sharded tensor gathered whole, one at a time.

    Every rank must drain it in full: each gather is a collective. A tensor registered under
    two names (tied embeddings) is gathered once.
    """
    state = model.state_dict()
    counts: dict[int, int] = {}
    for value in state.values():
        counts[id(value)] = counts.get(id(value), 0) + 1
    shared: dict[int, torch.Tensor] = {}
    for name, value in state.items():
        if counts[id(value)] > 1:
            if id(value) not in shared:
                shared[id(value)] = full(value)
            yield name, shared[id(value)]
        else:
            yield name, full(value)


def parameter_aliases(model: nn.Module) -> list[list[str]]:
    """Names of each parameter, in module order (a tied parameter has several)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def optimizer_state_by_index(state: dict, index: dict[str, int]) -> dict:
    """A full optimizer state keyed by parameter name (torch.distributed.checkpoint's layout) in
    ``Optimizer.state_dict()``'s layout, keyed by position, which is what the files hold."""
    return {"state": {index[name]: values for name, values in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """The inverse of ``optimizer_state_by_index``; ``names[i]`` is the i-th optimized parameter."""
    return {"state": {names[int(i)]: values for i, values in state["state"].items()},
            "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                             for group in state["param_groups"]]}
