"""`everyprompt serve`: an OpenAI-compatible HTTP server over the native engine (docs/serving.md)."""
