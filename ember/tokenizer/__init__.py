"""Tokenizers and chat templates from the model files (pure Python, no torch)."""
