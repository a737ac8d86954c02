"""The ``nemo_gym`` environment: NVIDIA NeMo-Gym's servers play the rollouts (``environment``).

``servers`` starts and stops them in NeMo-Gym's own Python; ``protocol`` converts rows to ``/run``
bodies and ``/verify`` answers to ``AgentResult``; ``gym_apps`` holds the files NeMo-Gym's Python
runs. The spec and config are in ``grpo_sdk.environments.nemo_gym_spec``.
"""
