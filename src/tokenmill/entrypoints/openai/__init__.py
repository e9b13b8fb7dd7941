"""The OpenAI-compatible API: its schemas, routes, streaming, the Responses API and its store, request fields."""
