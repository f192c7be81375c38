"""Training: the full state dict and optimizer check, activation checkpointing, saving and resuming a run."""
