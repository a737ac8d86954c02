"""The trainer: the training run (``trainer.trainer``) and what it needs around the step.

Light to import: modules that need torch (the trainer, rollouts) import it themselves, so the CLI
can use the run-directory lock and the stop signals (``run_dir``, ``signals``) before torch loads.
"""
