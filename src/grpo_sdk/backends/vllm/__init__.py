"""The vLLM generation backend (``pip install 'grpo-sdk[vllm]'``).

``spec`` and ``config`` are light; ``generation`` imports vLLM and is loaded only when a run
selects ``policy.generation.backend: vllm``.
"""
