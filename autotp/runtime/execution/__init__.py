"""One rank's module over one group: compile, apply a plan, run the rank-local graph, check inputs, shards."""
