"""The contract layer: protocols, records, config and errors. It imports nothing else of grpo-sdk.

Light to import (no torch): the CLI validates configs with it before anything heavy loads. The
training run itself is ``grpo_sdk.trainer``.
"""
