"""Model files to named tensors: GGUF and Hugging Face safetensors folders."""
