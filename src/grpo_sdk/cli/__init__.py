"""The `grpoctl` command line."""
