"""Serving: sampling, the scheduler that batches sequences, the prefix cache and the
engine that owns them."""
