"""The OpenAI-compatible API: its schemas, routes, the encoders of output events (chat, completions, Responses) and their SSE driver, the Responses API and its store, request fields."""
