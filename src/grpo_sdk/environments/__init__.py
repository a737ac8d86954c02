"""Built-in environments; ``specs`` holds their light entry-point targets and configs."""
