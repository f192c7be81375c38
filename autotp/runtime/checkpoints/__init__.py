"""Weights from and to disk: each rank's blocks read from safetensors; saved and reloaded at any world size."""
