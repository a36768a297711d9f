"""Serving online: a streaming engine front and an OpenAI-compatible server.

    async_llm.py   AsyncLLM: the step loop in a background thread, requests as async streams
    encoder.py     PromptEncoder: prompts tokenized in a worker thread, off the step loop
    server.py      the HTTP server (FastAPI + uvicorn): /v1/completions, /v1/chat/completions, /metrics
    protocol.py    the OpenAI request bodies and their validation
    guards.py      limits and checks before the engine: body size, JSON depth, text, API key, queue
    shutdown.py    a bounded graceful shutdown (SIGTERM / Ctrl-C) for uvicorn
    cli.py         python -m minillm serve: flags checked before the model loads
    prometheus.py  the /metrics exposition: every metric name declared once, its collector
    trace_recorder.py  serve --record-trace: the traffic received, as a trace that load replays

The load generator speaks only HTTP and lives with the measuring kit (``minillm.bench.loadgen``).

Imported lazily: ``from minillm.serving.server import serve_in_background``.
"""
