"""What runs on each rank: the rank-local module and the slicing of weights into shards."""
