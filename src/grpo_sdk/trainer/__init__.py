"""The trainer: the training run (``trainer.trainer``) and what it needs around the step: its
state, checkpoints, the run directory, stop signals and the launch from a config.

What produces the step's rollouts is ``grpo_sdk.rollouts``; where prompts come from,
``grpo_sdk.data``.

Light to import: modules that need torch (the trainer) import it themselves, so the CLI can use
the run-directory lock and the stop signals (``run_dir``, ``signals``) before torch loads.
"""
