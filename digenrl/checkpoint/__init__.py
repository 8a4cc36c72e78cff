"""Checkpoints: written atomically, found, checked against the model, read back in any sharding."""
