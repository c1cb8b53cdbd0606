"""Checkpoint and file formats: transformers', T5X's, and atomic writes of our own; and
transformers' LongT5 holding our parameters, the numerical reference."""
