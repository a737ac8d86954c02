"""Advantage estimators, one file each; ``specs`` holds their light entry-point targets and configs."""
