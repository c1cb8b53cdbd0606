"""Checkpoint and file formats: transformers', T5X's, and atomic writes of our own."""
