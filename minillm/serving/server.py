"""An OpenAI-compatible HTTP server over ``AsyncLLM`` (FastAPI + uvicorn).

    python -m minillm serve --port 8000 --engine paged --max-num-seqs 8
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'

Routes:

    POST /v1/completions        text in, text out; "stream": true for server-sent events
    POST /v1/chat/completions   messages in (the chat template is applied), an assistant message out
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs (HEAD too)
    GET  /metrics               Prometheus text: queue depths, KV blocks, token counters,
                                TTFT / ITL / end-to-end histograms, preemptions, speculation
                                (names and exporter: ``prometheus.py``)

Options: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``n`` (1 only),
``stream``, ``stream_options.include_usage``; extensions: ``top_k``, ``ignore_eos``
(exactly ``max_tokens`` tokens: what a load test wants) and ``priority`` (when the engine
has request priorities). The bodies: ``protocol.py``.

Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, with the status
of where they arise: the client's request (bad JSON, text or field: 400; no or a wrong API
key: 401; an unknown model: 404; a body past ``max_body_bytes``: 413; not
``application/json``: 415; the queue full: 429 with Retry-After; ``guards.py``) or the
engine (it has stopped or a step failed: 503, and ``/health`` says so). Anything else is
a 500 without a traceback. Messages quote at most a short prefix of any input.

Every request whose client goes away is aborted and its KV blocks freed: a stream when
its connection closes, a non-streaming request too (the handler watches for the
disconnect while it waits). Prompts are tokenized off the engine's step loop
(``encoder.py``), so a long one never delays the others' steps.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request

from ..sampling_params import SamplingParams
from . import guards
from .async_llm import AsyncLLM, EngineDeadError, RequestStream, sampling_params_fields
from .guards import BadRequest, RequestError, ServerLimits
from .prometheus import ServingMetrics
from .protocol import DEFAULT_MODEL_NAME, ChatCompletionRequest, CompletionRequest, _Body, one_prompt, parse_body
from .shutdown import GracefulServer, bind_socket
from .trace_recorder import TraceRecorder

logger = logging.getLogger("minillm.serving")

# A server runs many requests at once: the paged engine, unless told otherwise.
SERVER_ENGINE_DEFAULTS = {"engine": "paged"}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def build_app(async_llm: AsyncLLM, model_name: str = DEFAULT_MODEL_NAME, limits: ServerLimits | None = None,
              record_trace: str | TraceRecorder | None = None):
    """The FastAPI app serving ``async_llm`` under ``model_name`` (the ``model`` clients must send).

    ``limits``: body size, queue, API key (``ServerLimits``; default: 1 MiB bodies, no queue
    limit, no key). ``app.state.abort_in_flight()`` aborts this app's requests in flight
    (each ends with finish_reason "abort"); a graceful shutdown calls it. ``record_trace``: a
    path (or a ``TraceRecorder``) where every completion and chat request is written as a
    trace line that ``python -m minillm load --trace`` replays (``trace_recorder.py``);
    ``app.state.recorder`` holds it, whose ``close()`` is the caller's.
    """
    from fastapi import Depends, FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = limits or ServerLimits()
    # No /docs or /redoc: their pages load scripts from an outside CDN. /openapi.json stays.
    app = FastAPI(title="minillm", description="OpenAI-compatible server over minillm's engine",
                  docs_url=None, redoc_url=None)
    metrics = ServingMetrics(async_llm, model_name)
    app.state.llm, app.state.metrics, app.state.model_name = async_llm, metrics, model_name
    engine = async_llm.engine
    max_model_len = engine.max_model_len
    params_fields = sampling_params_fields()
    created = int(time.time())
    admission = guards.Admission(async_llm, engine.resolved.max_num_seqs, limits.max_queued_requests)
    active: set[RequestStream] = set()  # this app's requests in the engine (event loop only)
    app.state.limits, app.state.admission, app.state.active = limits, admission, active
    recorder = record_trace if record_trace is None or isinstance(record_trace, TraceRecorder) \
        else TraceRecorder(record_trace)
    app.state.recorder = recorder

    def abort_in_flight() -> int:
        streams = list(active)
        for stream in streams:
            stream.finish_early()
        return len(streams)

    app.state.abort_in_flight = abort_in_flight

    def reject(message: str, param: str | None = None, code: str | None = None, status: int = 400,
               type_: str | None = None, headers: dict[str, str] | None = None):
        metrics.count_error(status)
        type_ = type_ or ("invalid_request_error" if status < 500 else "internal_error")
        return JSONResponse(error_body(_printable(guards.clip(message)), type_, param and _printable(param), code),
                            status_code=status, headers=headers)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return reject(str(exc), exc.param, exc.code, exc.status, exc.type, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return reject(f"{exc.detail}: {request.method} {guards.clip(request.url.path, 200)}", code=code,
                      status=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)  # the traceback stays in the server log
        return reject(f"internal server error ({type(exc).__name__})", status=500)

    async def authorized(request: Request) -> None:
        guards.check_api_key(request.headers, limits.api_key)

    v1 = [Depends(authorized)]

    def params_factory(body: _Body, max_tokens: int | None):
        """The SamplingParams, built in the engine thread once the prompt's length is known."""
        kwargs: dict[str, Any] = dict(temperature=float(body.temperature), top_p=float(body.top_p),
                                      top_k=body.top_k, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos)
        if body.priority is not None and "priority" in params_fields:
            kwargs["priority"] = body.priority

        def make(num_prompt_tokens: int) -> SamplingParams:
            room = max_model_len - num_prompt_tokens
            n = max_tokens
            if n is None:
                n = max(room, 1)  # up to the end of the context; a prompt with no room is rejected next
            elif room >= 1 and n > room:
                raise BadRequest(f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                                 f"has {num_prompt_tokens} tokens and max_tokens is {n}: lower max_tokens to at "
                                 f"most {room} or shorten the prompt", "max_tokens", "context_length_exceeded")
            return SamplingParams(max_tokens=n, **kwargs)

        return make

    async def start(body: _Body, prompt: Any, messages: Any, max_tokens: int | None, rid: str) -> RequestStream:
        priority = body.priority if body.priority is not None and "priority" not in params_fields else None
        stream = await async_llm.add_request(prompt, params_factory(body, max_tokens), rid, messages=messages,
                                             priority=priority)
        active.add(stream)
        metrics.prompt_tokens.inc(stream.request.num_prompt_tokens)
        return stream

    async def handle(request: Request, chat: bool):
        arrival = recorder.arrived() if recorder is not None else 0.0
        guards.check_content_type(request.headers)
        raw = await guards.read_body(request, limits.max_body_bytes)  # read whole: the connection stays usable
        with admission.slot():  # 429 past the queue limit; held until the request is in the engine
            data = guards.load_json(raw, limits.max_json_depth)
            del raw
            if chat:
                body = parse_body(data, ChatCompletionRequest, model_name)
                messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                             else "".join(p.text for p in m.content)} for m in body.messages]
                prompt, max_tokens = None, body.max_completion_tokens or body.max_tokens
                rid = f"chatcmpl-{uuid.uuid4().hex}"
            else:
                body = parse_body(data, CompletionRequest, model_name)
                prompt, messages, max_tokens = one_prompt(body.prompt), None, body.max_tokens
                rid = f"cmpl-{uuid.uuid4().hex}"
            del data
            try:
                stream = await start(body, prompt, messages, max_tokens, rid)
            except RequestError:
                raise
            except ValueError as e:  # the prompt, SamplingParams or the engine said no: the message names the field
                return reject(str(e), code="invalid_request")
            except EngineDeadError as e:  # the engine loop has stopped (shut down, or a step failed)
                logger.error("rejected a request: %s", e)
                return reject("the engine is not running", code="engine_unavailable", status=503)
            if recorder is not None:
                recorder.start(stream, arrival, prompt, messages, max_tokens)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:  # the response watches for the client's disconnect itself (_SSEResponse)
            return _SSEResponse(_sse(stream, rid, chat, include_usage), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        # Nothing is sent until the end: watch the connection meanwhile, and abort if it closes.
        gone = asyncio.ensure_future(_disconnected(request))
        gone.add_done_callback(lambda t: t.cancelled() or t.exception() is not None or stream.finish_early())
        try:
            final = None
            async for out in stream:
                metrics.observe(out)
                final = out
        except Exception:
            if not async_llm.is_running:  # a step failed: the engine's failure, not this request's
                logger.exception("request %s failed with the engine", rid)
                return reject("the engine is not running", code="engine_unavailable", status=503)
            raise
        finally:
            gone.cancel()
            stream.abort()  # a no-op once finished; frees the blocks if this handler was cancelled
            active.discard(stream)
            if recorder is not None:
                recorder.end(stream)
        o = final.output
        usage = _usage(len(o.prompt_token_ids), len(o.token_ids))
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                      "finish_reason": final.finish_reason}
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": o.text, "logprobs": None, "finish_reason": final.finish_reason}
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": usage}

    async def _sse(stream: RequestStream, rid: str, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        now = int(time.time())

        def chunk(choices: list, **extra: Any) -> str:
            d = {"id": rid, "object": obj, "created": now, "model": model_name, "choices": choices, **extra}
            return f"data: {json.dumps(d, separators=(',', ':'))}\n\n"

        try:
            if chat:  # the role comes first, as OpenAI sends it
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            final = None
            async for out in stream:
                metrics.observe(out)
                if not (out.token_ids or out.text or out.finished):
                    continue
                fr = out.finish_reason if out.finished else None
                if chat:
                    delta = {"content": out.text} if out.text or not out.finished else {}
                    yield chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fr}])
                else:
                    yield chunk([{"index": 0, "text": out.text, "logprobs": None, "finish_reason": fr}])
                final = out
            if include_usage and final is not None:
                yield chunk([], usage=_usage(final.num_prompt_tokens, final.num_output_tokens))
            yield "data: [DONE]\n\n"
        except Exception as e:  # the engine failed mid-stream: the headers (200) are gone, so say it in the stream
            logger.exception("request %s failed mid-stream", rid)
            yield f"data: {json.dumps(error_body(f'internal server error ({type(e).__name__})', 'internal_error'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()  # the client went away (or we are done): free its blocks now
            active.discard(stream)
            if recorder is not None:
                recorder.end(stream)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "minillm", "max_model_len": max_model_len}]}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not async_llm.is_running:
            return JSONResponse(error_body("the engine loop is not running", "internal_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(content=data, media_type=content_type)

    return app


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _printable(text: str) -> str:
    """``text`` with any lone surrogate escaped: an error body must encode as UTF-8."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse_response_class():
    from starlette.responses import StreamingResponse

    class SSEResponse(StreamingResponse):
        """A StreamingResponse that always closes its generator, so its ``finally`` (the
        abort) runs at once when the client goes away, not whenever it is collected."""

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()

    return SSEResponse


class _LazySSE:
    cls = None

    def __call__(self, *args, **kwargs):
        if _LazySSE.cls is None:
            _LazySSE.cls = _sse_response_class()
        return _LazySSE.cls(*args, **kwargs)


_SSEResponse = _LazySSE()


# -- running it -------------------------------------------------------------------------------

@dataclass
class ServerHandle:
    """A server running in a background thread. ``with serve_in_background() as h: ...``."""

    url: str
    llm: AsyncLLM
    host: str
    port: int
    app: Any
    server: Any = field(repr=False)
    thread: threading.Thread = field(repr=False)
    owns_llm: bool = field(default=True, repr=False)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the HTTP server (requests still running after ``GRACE_S`` are aborted); shut the
        engine loop down too if this handle built it."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if getattr(self.app.state, "recorder", None) is not None:
            self.app.state.recorder.close()  # the requests still open are written as far as they got
        if self.owns_llm:
            self.llm.shutdown()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


GRACE_S = 2.0  # serve_in_background: how long requests in flight may run on after stop()


def serve_in_background(host: str = "127.0.0.1", port: int = 0, *, async_llm: AsyncLLM | None = None,
                        model_name: str = DEFAULT_MODEL_NAME, log_level: str = "warning",
                        timeout: float = 60.0, limits: ServerLimits | None = None,
                        record_trace: str | TraceRecorder | None = None, **engine_kwargs: Any) -> ServerHandle:
    """Start the server in a thread and return once it accepts connections.

    ``port=0`` picks a free port (``handle.url`` says which). ``async_llm`` reuses an
    engine with its weights already loaded (then ``engine_kwargs`` must be empty, and
    ``stop()`` leaves it running); otherwise one is built from ``engine_kwargs``
    (``LLM(...)``'s options; the server's default engine is ``paged``). ``limits``: the
    server's limits (``ServerLimits``: body size, queue, API key). ``record_trace``: write the
    traffic as a replayable trace (``build_app``); ``stop()`` closes it.
    """
    import uvicorn

    if async_llm is not None and engine_kwargs:
        raise ValueError(f"give engine options ({', '.join(sorted(engine_kwargs))}) or async_llm, not both")
    sock = bind_socket(host, port)
    owns = async_llm is None
    llm = None
    try:
        llm = async_llm or AsyncLLM.from_config(**{**SERVER_ENGINE_DEFAULTS, **engine_kwargs})
        app = build_app(llm, model_name=model_name, limits=limits, record_trace=record_trace)
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, access_log=False)
        server = GracefulServer(config, on_grace_expired=app.state.abort_in_flight, grace=GRACE_S)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="minillm-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
    except BaseException:
        sock.close()
        if owns and llm is not None:
            llm.shutdown()
        raise
    url_host = f"[{host}]" if ":" in host else host
    return ServerHandle(f"http://{url_host}:{port}", llm, host, port, app, server, thread, owns)


__all__ = ["build_app", "serve_in_background", "ServerHandle", "ServingMetrics", "ServerLimits",
           "CompletionRequest", "ChatCompletionRequest", "error_body", "DEFAULT_MODEL_NAME"]
