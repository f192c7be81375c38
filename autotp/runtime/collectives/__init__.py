"""The collectives a rank-local graph calls: their forms (ring, shared or symmetric memory), hosts, watched waits."""
