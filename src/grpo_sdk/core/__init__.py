"""The contract layer: protocols, records, errors, kinds, capabilities and ``option``, with the light
helpers beside them (models, hub, machine, files). It imports nothing else of grpo-sdk.

Light to import (no torch). The run configuration, its loading and its checks are
``grpo_sdk.config``; the training run itself is ``grpo_sdk.trainer``.
"""
