"""What runs on each rank: the rank-local module and the slicing of weights into shards
(training: :mod:`.training` — full state dicts and the checks around an optimizer step)."""
