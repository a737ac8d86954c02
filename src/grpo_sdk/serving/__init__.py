"""The rollout endpoint: the policy behind an OpenAI-compatible HTTP API (docs/agents.md).

An agent written with any framework trains by swapping its ``base_url``: the endpoint samples
from the run's generation backend, records every turn's exact tokens per rollout session
(``sessions``), and the trainer builds the episode from those tokens. ``grpoctl serve`` runs the
same endpoint stand-alone over a model directory or a checkpoint.

Modules: ``engine`` (requests to batched generation calls), ``sessions`` (the recorded turns),
``openai_api`` (the wire format), ``endpoint`` (the routes' logic), ``server`` (HTTP).
Importing this package imports nothing heavy; the engine imports torch when it first generates.
"""
