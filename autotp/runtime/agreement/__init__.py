"""Ranks agree or fail together: exchanges, one trace and one plan per group, a failed peer told to the others."""
