"""What runs on each rank, in rooms by role: execution, collectives, agreement, generation, checkpoints,
training and the mesh (docs/architecture.md, "Rooms")."""
