"""The fault campaign's fixtures; the helpers live in tests/faults/campaign.py."""

from faults.campaign import reference  # noqa: F401 - a fixture: pytest finds it here
