"""The OpenAI-compatible server: api.py (routes), protocol.py (request and response bodies),
metrics.py (Prometheus), chat.py (chat templates), loadgen.py (`bole bench-serve`)."""
