"""Which tokens each request computes in the next step (plain Python, no torch)."""
