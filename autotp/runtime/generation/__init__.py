"""Text generation: the KV cache as graph state, prefill and decode graphs, generation on demand, the token loop."""
