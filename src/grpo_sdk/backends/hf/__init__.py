"""The embedded backend: torch + transformers, for any Hugging Face causal LM, on CPU or one GPU.

``spec`` and ``config`` are light (they are what `grpoctl plugins list` and `config validate`
import); ``generation`` and ``policy`` import torch and are loaded only when a run selects them.
"""
