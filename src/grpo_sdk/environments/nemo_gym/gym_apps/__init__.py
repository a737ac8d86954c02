"""Files that NeMo-Gym's own Python runs (>= 3.12, its virtual environment), never imported by grpo-sdk.

``launch.py`` starts one NeMo-Gym server (an app.py) without Ray; ``calculator.py`` is the resources
server grpo-sdk ships (``env.nemo_gym.resources_server: builtin:calculator``), written with NeMo-Gym's
base classes. They live in the package so that a wheel carries them.
"""
