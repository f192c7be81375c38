"""autotp."""
