"""A model over a DeviceMesh (dp x pp x tp): stages and replicas of tensor-parallel groups, and generation."""
