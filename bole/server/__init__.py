"""The OpenAI-compatible server: api.py (routes), protocol.py (request and response bodies),
metrics.py (Prometheus), chat.py (chat templates), engine_process.py (the engine in a process of its own)."""
