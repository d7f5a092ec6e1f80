"""The engine: EngineCore steps, output processing, and the LLM API."""
