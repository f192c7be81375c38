"""Capture, the first stage: torch.export into an ATen FX graph, the trace cache, stamping of repeated layers."""
