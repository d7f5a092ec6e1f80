"""Quantized weight formats: GGUF blocks and their dequantization."""
