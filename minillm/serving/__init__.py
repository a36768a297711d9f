"""Serving online: a streaming engine front, an OpenAI-compatible server, a load generator.

    async_llm.py   AsyncLLM: the step loop in a background thread, requests as async streams
    server.py      the HTTP server (FastAPI + uvicorn): /v1/completions, /v1/chat/completions, /metrics
    load.py        an open-loop load generator that speaks only the OpenAI API

Imported lazily: ``from minillm.serving.server import serve_in_background``.
"""
