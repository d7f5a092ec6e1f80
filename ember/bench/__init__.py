"""`ember bench`: a load-testing benchmark for any OpenAI-compatible server (HTTP only)."""
