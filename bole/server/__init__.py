"""The OpenAI-compatible server: api.py (the app, its routes and the server's state),
responses.py (whole and streamed responses), protocol.py (request and response bodies),
errors.py, gate.py (authentication), metrics.py (Prometheus), chat.py (chat templates),
engine_process.py (the engine in a process of its own), replicas.py (Ray Serve replicas)."""
