"""Logits processors and the sampler."""
