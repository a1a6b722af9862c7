"""Training: the trainer loop and its checkpoints."""
