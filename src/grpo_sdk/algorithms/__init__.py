"""Algorithm math in pure torch: the clipped policy-gradient loss and its helpers."""
