"""The HTTP server: the app and its lifecycle, admission and per-model state, job streams, auth, metrics, errors, several models, adapter routes."""
