"""Inference: decoding, a checkpoint made ready to decode, evaluation and ROUGE."""
