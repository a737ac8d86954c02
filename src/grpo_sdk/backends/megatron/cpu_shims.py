"""Test-only CPU shims for megatron-core 0.16.1 on a CPU-only torch (2.13.0+cpu, gloo, world size 1).

Megatron-Core is not a supported CPU configuration: it hard-codes CUDA in many places. These patches
let a tiny ``GPTModel`` build, run forward/backward (with W5 also under full activation recompute)
and (with W4) go through the mcore schedules, DDP wrapper and optimizer on this CPU, so the megatron
backend can be smoke-tested in CI. They are a **test-only hack**: :func:`apply` refuses to run when
CUDA is available, and nothing in the backend applies them on its own. Real validation belongs on a
GPU (research/feasibility.md §4, Appendix C).

The shims (W1-W4 numbered as in feasibility.md §4, W5 added here; file:line refs are into
megatron-core 0.16.1):

W2  RNG tracker. ``model_parallel_cuda_manual_seed`` asserts "Torch not compiled with CUDA enabled"
    (the tracker's ``add`` calls ``torch.cuda.get_rng_state``, megatron/core/tensor_parallel/
    random.py:235/238), and without a registered state attention dropout fails with
    "cuda rng state model-parallel-rng is not added" (it runs under ``get_cuda_rng_tracker().fork()``).
    Fix: mcore's public ``initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)``
    (random.py:286), whose tracker's ``add``/``fork`` are no-ops. Dropout then draws from the CPU
    generator, so keep dropout at 0 for exact comparisons.

W3  ``torch.cuda.current_device``. Used at ~175 call sites, e.g. the global memory buffer
    (megatron/core/utils.py:631 ``device=torch.cuda.current_device()``, reached from
    transformer/dot_product_attention.py:189) and RoPE (models/common/embeddings/
    rotary_pos_embedding.py:162 ``self.inv_freq.to(device=torch.cuda.current_device())``).
    Fix: ``torch.cuda.current_device`` returns ``torch.device("cpu")``.

W4  Hard-coded ``device="cuda"`` / ``.cuda()`` (78 lines in 33 files), e.g. pipeline_parallel/
    schedules.py:596 ``torch.zeros([], dtype=torch.int, device="cuda")``, optimizer/optimizer.py:907
    ``torch.tensor([1.0], dtype=torch.float, device='cuda')``, the causal mask on the forward path
    (transformer/utils.py:35 ``torch.ones(sq, sq, device="cuda")``, reached from
    fusions/fused_softmax.py:327 when ``attention_mask=None``), and mbridge 0.15.1's ``get_model``
    (mbridge/core/util.py:151 ``model_module.cuda(torch.cuda.current_device())``). Fix: a ``TorchFunctionMode`` that rewrites
    a ``device=`` keyword that is an int or starts with "cuda" to "cpu", and ``torch.Tensor.cuda`` as
    the identity (``nn.Module.cuda`` goes through it). Still needed with it: ``OptimizerConfig(
    clip_grad=0.0)``, since optimizer/clip_grads.py:167 asserts ``param.grad.type() ==
    'torch.cuda.FloatTensor'``.

W5  Activation recompute (``recompute_granularity="full"``). ``CheckpointFunction.forward`` saves
    all RNG states (megatron/core/tensor_parallel/random.py:514 ``_get_all_rng_states()``), which
    reads the CUDA generator (random.py:447 -> :55 ``torch.cuda.random.get_rng_state(device=
    "cuda")``) and fails with AssertionError "Torch not compiled with CUDA enabled"; ``backward``
    restores them (random.py:552 ``_set_all_rng_states`` -> :457 ``_set_cuda_rng_state``).
    Fix: the module's ``_get_cuda_rng_state`` returns None and ``_set_cuda_rng_state`` does
    nothing, since there is no CUDA generator to save. RNG semantics: ``_get_all_rng_states``
    still saves and restores the CPU generator (``torch.get_rng_state``) and the tracker states
    (empty under W2), so the recomputed forward draws the same CPU random numbers (dropout masks) as
    the original forward did, as megatron does for the CUDA generator on a GPU (checked once by hand:
    ``tensor_parallel.checkpoint`` of a p=0.5 dropout layer gave the un-checkpointed output and input
    gradient exactly). Covers ``CheckpointWithoutOutput`` (random.py:656/681) too.

(W1, a patched ``GlobalMemoryBuffer.get_tensor``, is subsumed by W3 and not applied.)

A further CPU adaptation, not a CUDA shim: :func:`use_local_layer_spec` makes an mbridge bridge
build the model with Megatron-Core's local (non-Transformer-Engine) layer spec, since Transformer
Engine does not install here.

Usage::

    with cpu_shims.applied():
        ...  # init gloo, initialize_model_parallel, build and run the model

or ``undo = cpu_shims.apply(); ...; undo()``. Applying twice is a no-op for the second call (its
undo does nothing); the first undo restores everything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class CudaToCpu(TorchFunctionMode):
    """W4: rewrite a ``device=`` keyword naming a CUDA device (an int or "cuda...") to "cpu"."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and (
            (isinstance(device, int) and not isinstance(device, bool))
            or str(device).startswith("cuda")
        ):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


_active: bool = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _tensor_cuda_identity(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def apply() -> Callable[[], None]:
    """Apply W2, W3, W4 and W5; return a function that undoes them.

    W2 resets megatron's global RNG tracker (so ``megatron.core`` must be importable); apply before
    building the model. Raises RuntimeError when CUDA is available: these shims are for CPU only.
    """
    global _active
    if torch.cuda.is_available():
        raise RuntimeError(
            "grpo_sdk.backends.megatron.cpu_shims is a test-only CPU hack; CUDA is available, "
            "so run Megatron-Core unpatched"
        )
    if _active:
        return lambda: None

    from megatron.core.tensor_parallel import random as mcore_random

    saved_current_device = torch.cuda.current_device
    saved_tensor_cuda = torch.Tensor.cuda
    saved_tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    saved_tracker_initialized = mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    saved_get_cuda_rng_state = mcore_random._get_cuda_rng_state
    saved_set_cuda_rng_state = mcore_random._set_cuda_rng_state

    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]  # W3
    torch.Tensor.cuda = _tensor_cuda_identity  # type: ignore[method-assign]  # W4
    mode = CudaToCpu()
    mode.__enter__()  # W4
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # W2
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state  # W5
    mcore_random._set_cuda_rng_state = _no_cuda_rng_state  # W5
    _active = True

    def undo() -> None:
        global _active
        if not _active:
            return
        mode.__exit__(None, None, None)
        torch.Tensor.cuda = saved_tensor_cuda  # type: ignore[method-assign]
        torch.cuda.current_device = saved_current_device  # type: ignore[assignment]
        mcore_random._CUDA_RNG_STATE_TRACKER = saved_tracker
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker_initialized
        mcore_random._get_cuda_rng_state = saved_get_cuda_rng_state
        mcore_random._set_cuda_rng_state = saved_set_cuda_rng_state
        _active = False

    return undo


@contextlib.contextmanager
def applied() -> Iterator[None]:
    """A context manager around :func:`apply`."""
    undo = apply()
    try:
        yield
    finally:
        undo()


def use_local_layer_spec(bridge: Any) -> Any:
    """Make an mbridge ``LLMBridge`` build with Megatron-Core's local layer spec (no Transformer Engine).

    mbridge 0.15.1's ``LLMBridge._get_transformer_layer_spec`` (mbridge/core/llm_bridge.py:127-152)
    always asks for ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``, and its
    weight-name maps use TE's fused names (``self_attention.linear_qkv.layer_norm_weight``,
    ``mlp.linear_fc1.layer_norm_weight``). The local spec keeps the norms as separate modules
    (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``), so this also adds those two names to
    the bridge's maps (on the instance only). Returns the bridge.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def local_spec(vp_stage: int | None = None) -> Any:
        assert bridge.config.normalization == "RMSNorm", "only RMSNorm is supported"
        bridge.has_vp_stage = True
        return get_gpt_decoder_block_spec(
            bridge.config, use_transformer_engine=False, vp_stage=vp_stage
        )

    bridge._get_transformer_layer_spec = local_spec
    # ".self_attention." is not in "decoder.layers.N.input_layernorm.weight", so it is mapped by
    # _OTHER_MAPPING; "pre_mlp_layernorm" contains "mlp", so it goes through _MLP_MAPPING.
    bridge._OTHER_MAPPING = {
        "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
        **type(bridge)._OTHER_MAPPING,
    }
    bridge._MLP_MAPPING = {
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        **type(bridge)._MLP_MAPPING,
    }
    return bridge
