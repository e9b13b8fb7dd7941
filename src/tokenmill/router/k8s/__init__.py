"""Kubernetes: the InferencePool's members and weights, and the Gateway API endpoint picker (ext_proc)."""
