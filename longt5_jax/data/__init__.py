"""Data: record sources, the embedded ACLSum task, tokenizers, objectives and batching."""
