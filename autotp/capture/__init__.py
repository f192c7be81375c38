"""Capture, the first stage: torch.export into an ATen FX graph, the trace cache, stamping of repeated layers,
and a causal LM's KV cache held as graph state (the decode step that generation compiles and plans price)."""
