"""grpo-sdk's TensorRT-LLM worker extension: upstream's RL hooks plus the disk and collective weight paths.

Give it to the engine as ``ray_worker_extension_cls="grpo_sdk.backends.trtllm.worker_extension.GrpoWorkerExtension"``
(engine mode does; for trtllm-serve put it, with ``orchestrator_type: ray``, in the YAML of
``--extra_llm_api_options``, docs/trtllm.md). TensorRT-LLM mixes the class into each Ray GPU worker,
which then has ``self.engine`` (the PyExecutor) and ``self.device_id``.

Written against ``tensorrt_llm/llmapi/rlhf_utils.py`` (``WorkerExtension``, ``control_action_decorator``
from ``tensorrt_llm/_ray_utils.py``; NVIDIA/TensorRT-LLM 04762f3b) and NeMo-RL's ``NcclExtension``
(``nemo_rl/models/generation/trtllm/trtllm_backend.py``, NVIDIA-NeMo/RL 7ea279ab), whose finalise
step this follows (``WorkerExtension.finalize_weight_update`` where the installed version has it,
otherwise the per-module ``process_weights_after_loading`` / ``post_load_weights`` loop). It imports
TensorRT-LLM, so only an engine process imports it; the logic lives in refit.py, which runs and is
tested without TensorRT-LLM. Not run against a real engine yet (benchmarks/gpu/check_trtllm.py does).
"""

from __future__ import annotations

from typing import Any

from tensorrt_llm._ray_utils import control_action_decorator
from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension

from grpo_sdk.backends.trtllm.refit import RefitReceiver, parse_command


class GrpoWorkerExtension(WorkerExtension):
    def update_weights(self, ipc_handles: dict | None = None) -> Any:
        """trtllm-serve's ``/update_weights`` lands here: a grpo-sdk command, or upstream's IPC handles /
        finalise (drained by upstream's own decorator)."""
        body = parse_command(ipc_handles)
        if body is None:
            return super().update_weights(ipc_handles)
        return self.grpo_refit(body)

    @control_action_decorator
    def grpo_refit(self, body: dict) -> dict:
        """One grpo-sdk command, with the engine drained (no request runs while weights change)."""
        return self._grpo_receiver().run(body)

    def grpo_device_uuid(self) -> str:
        """The key upstream's ``update_weights`` looks this worker's IPC handles up by."""
        from tensorrt_llm._torch.utils import get_device_uuid

        return get_device_uuid(self.device_id)

    def _grpo_receiver(self) -> RefitReceiver:
        receiver = getattr(self, "_grpo_refit_receiver", None)
        if receiver is None:
            import torch
            import torch.distributed as dist

            # Rank within the engine: TensorRT-LLM's Ray workers form their own default group (TP).
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            device = f"cuda:{self.device_id}" if torch.cuda.is_available() else "cpu"
            receiver = RefitReceiver(self._grpo_load, self._grpo_finalize, device=device, rank=rank)
            self._grpo_refit_receiver = receiver
            self._grpo_loading = False
        return receiver

    def _grpo_load(self, weights: dict) -> None:
        model_engine = self.engine.model_engine
        if not self._grpo_loading:  # once per update, before the first tensor (as upstream does)
            for module in model_engine.model.modules():
                if hasattr(module, "pre_reload_weights") and not getattr(module, "_weights_removed", False):
                    module.pre_reload_weights()
            self._grpo_loading = True
        model_engine.model_loader.reload(model_engine.model, weights, allow_partial_loading=True)

    def _grpo_finalize(self, version: int) -> None:
        import torch

        finalize = getattr(WorkerExtension, "finalize_weight_update", None)
        if finalize is not None:
            finalize(self)
        else:
            for module in self.engine.model_engine.model.modules():
                if getattr(module, "_weights_removed", False):
                    continue
                if hasattr(module, "process_weights_after_loading"):
                    module.process_weights_after_loading()
                if hasattr(module, "post_load_weights"):
                    module.post_load_weights()
        self.engine.reset_prefix_cache()  # cached KV was computed with the old weights
        self._grpo_loading = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
