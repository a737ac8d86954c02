"""TensorRT-LLM generation backend (docs/trtllm.md): engine mode (the LLM API in this process) and
server mode (trtllm-serve over HTTP). The entry point is spec.py; nothing here imports TensorRT-LLM."""
