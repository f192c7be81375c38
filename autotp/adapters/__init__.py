"""Adapters to the internals of other libraries: one module per dependency, with the releases it is tested on."""
