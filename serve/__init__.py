"""Serve deployments and the OpenAI API (not built yet)."""
