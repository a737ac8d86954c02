"""Entry-point target of the TensorRT-LLM backend (light: no tensorrt_llm import here)."""

from grpo_sdk.plugins import ComponentSpec

GENERATION = ComponentSpec(
    name="trtllm",
    kind="generation",
    impl="grpo_sdk.backends.trtllm.generation:TrtllmGeneration",
    config="grpo_sdk.backends.trtllm.config:TrtllmConfig",
    check="grpo_sdk.backends.trtllm.config:check_options",
    # Not in `requires`: server mode needs nothing installed here. Engine mode's check calls
    # require_engine("tensorrt_llm", ...) instead (exit 3 with the install line).
    extra="trtllm",
    # cuda_ipc: update_weights turns CUDA tensors into IPC handles for the engine's own workers
    # (TensorRT-LLM's WorkerExtension.update_weights). receives_broadcast: the engine's workers join
    # the collective transport's group through grpo-sdk's worker extension (worker_extension.py).
    capabilities={"cuda_ipc", "receives_broadcast"},
    summary="Generation on TensorRT-LLM (PyTorch backend): the LLM API in this process, or a trtllm-serve over HTTP.",
)
