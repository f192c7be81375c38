"""Base values every stage shares: placements, errors, strategies. Imports nothing above it."""
