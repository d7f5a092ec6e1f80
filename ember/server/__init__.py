"""The OpenAI-compatible HTTP server (no torch here: it talks to the AsyncEngine API)."""
