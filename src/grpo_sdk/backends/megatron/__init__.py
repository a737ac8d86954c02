"""The Megatron-Core backend (work in progress, issue 18): a Megatron-Core ``GPTModel`` built from a
Hugging Face model directory through verl's ``mbridge``.

This package imports nothing heavy: megatron-core and mbridge are optional and live in their own
virtual environment on CI (``.ci/megatron-venv``). ``cpu_shims`` holds the test-only patches that let
megatron-core 0.16.1 run on a CPU-only torch; it is never applied when CUDA is available.
"""
