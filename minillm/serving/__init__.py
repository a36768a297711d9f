"""Serving online: a streaming engine front and an OpenAI-compatible server.

    async_llm.py   AsyncLLM: the step loop in a background thread, requests as async streams
    server.py      the HTTP server (FastAPI + uvicorn): /v1/completions, /v1/chat/completions, /metrics
    prometheus.py  the /metrics exposition: every metric name declared once, its collector

The load generator speaks only HTTP and lives with the measuring kit (``minillm.bench.loadgen``).

Imported lazily: ``from minillm.serving.server import serve_in_background``.
"""
