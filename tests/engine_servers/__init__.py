"""Stand-in engine servers for the engine adapters' tests (see base.py)."""
