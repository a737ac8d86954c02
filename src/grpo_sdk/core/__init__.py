"""The core: protocols, records, config and the training loop.

``protocols``, ``records``, ``config``, ``config_loader`` and ``errors`` are light (no torch).
``loop`` and ``context`` import torch and are imported only when a run starts.
"""
