"""Multi-LoRA serving: adapters read from files (adapter.py), the resident set (registry.py),
and one step's batched low-rank matmuls (batch.py)."""
