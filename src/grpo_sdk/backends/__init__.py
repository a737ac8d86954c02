"""Generation and policy backends; each registers through the entry points in pyproject.toml."""
