"""The OpenAI-style HTTP API: one router per resource, pydantic models as the contract."""
