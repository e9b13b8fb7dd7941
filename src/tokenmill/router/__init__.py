"""Cache-aware, load-aware router over many replicas (`tokenmill route`).

HTTP only: it never imports torch or the engine. ``core.Router`` holds the
backend pool, tokenizer and policy; ``proxy`` is the OpenAI-compatible reverse
proxy; ``ext_proc`` the Envoy endpoint picker for the Gateway API Inference
Extension; ``server`` runs both; ``workload`` drives tests and benchmarks.
"""
