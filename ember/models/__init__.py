"""The Llama family in PyTorch, reading and writing K/V through a paged cache."""
