"""The Megatron-Core backends: a policy (``policy``) and a generation (``generation``) on a Megatron-Core
``GPTModel`` built from a Hugging Face model directory through verl's ``mbridge`` (docs/megatron.md).

Modules: ``spec`` and ``config`` (light: the entry points and ``policy.megatron``), ``policy`` and
``parallel`` (training, TP/DP, vocab-parallel logprobs), ``generation`` and ``colocated`` (sampling, and
sharing the policy's model in one process), ``bridging`` (adapting mbridge to what is installed),
``hf_semantics`` (where the mcore model must behave like the HF one), ``cpu_shims`` (the test-only
patches that let megatron-core 0.16.1 run on a CPU-only torch; never applied when CUDA is available).

This package imports nothing heavy: megatron-core and mbridge are optional and live in their own
virtual environment on CI (``.ci/megatron-venv``).
"""
