"""The paged KV cache's bookkeeping, in plain Python (no torch)."""
