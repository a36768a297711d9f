"""What stands between a client and the engine: limits, checks and HTTP errors.

Every check here runs on the event loop before a request reaches the engine, and costs
at most one pass over the bytes the client sent (which ``max_body_bytes`` bounds):

    check_api_key      ``Authorization: Bearer <key>`` on every /v1 route, when a key is set   401
    check_content_type POST bodies are ``application/json`` (so a web page cannot make a
                       browser send a "simple" cross-origin POST that runs inference)         415
    Admission          at most max_num_seqs running + ``max_queued_requests`` waiting      429 + Retry-After
    read_body          at most ``max_body_bytes`` (Content-Length first, then as it streams) 413
    load_json          JSON; nesting at most ``MAX_JSON_DEPTH`` deep; every string valid
                       Unicode (no lone surrogates: the tokenizer cannot encode them)        400

``RequestError`` carries an HTTP status and OpenAI's error fields; the server answers it
with ``{"error": {"message", "type", "param", "code"}}``. Error messages quote at most
``MAX_QUOTE_CHARS`` of any input (``quote``), and the server clips any message to
``MAX_MESSAGE_CHARS`` on top (``clip``): a 10 MB field never comes back as a 10 MB error.
"""
from __future__ import annotations

import hmac
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~50x the largest prompt SmolLM2's 8192-token context can take as text
MAX_JSON_DEPTH = 32  # the deepest valid body is 5 levels (messages -> message -> content -> part)
MAX_QUOTE_CHARS = 120  # of one input quoted in an error message
MAX_MESSAGE_CHARS = 1000  # of any error message
RETRY_AFTER_S = 1  # what a 429 tells the client to wait, in seconds
DRAIN_BYTES = 16 << 20  # past the body limit, how much more is read (and dropped) so the client gets its 413


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits (``serve --max-body-bytes ... --max-queued-requests ... --api-key ...``).

    ``max_queued_requests``: None = unbounded (every request queues, as before); N = at
    most ``max_num_seqs`` requests running and N more admitted (tokenizing or waiting for
    a batch slot), the next one is answered 429 with ``Retry-After``. ``api_key``: None = no
    authentication.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_requests: int | None = None
    api_key: str | None = None
    max_json_depth: int = MAX_JSON_DEPTH

    def __post_init__(self) -> None:
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        q = self.max_queued_requests
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 0):
            raise ValueError(f"max_queued_requests must be None (unbounded) or an integer >= 0, got {q!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or not self.api_key.isascii()):
            raise ValueError("api_key must be a non-empty ASCII string (or None: no authentication)")
        if isinstance(self.max_json_depth, bool) or not isinstance(self.max_json_depth, int) or self.max_json_depth < 8:
            raise ValueError(f"max_json_depth must be an integer >= 8, got {self.max_json_depth!r}")


# -- errors ------------------------------------------------------------------------------------

class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error fields."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None, *,
                 status: int | None = None, type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.param, self.code = param, code
        if status is not None:
            self.status = status
        if type_ is not None:
            self.type = type_
        self.headers = headers or {}


class BadRequest(RequestError, ValueError):
    """HTTP 400: the client's mistake, named (a ValueError, as the engine's own checks are)."""


def quote(value: Any, limit: int = MAX_QUOTE_CHARS) -> str:
    """``repr(value)``, at most ``limit`` characters of it: for quoting an input in a message."""
    if isinstance(value, (list, dict, tuple)) and len(value) > limit:
        return f"<a {type(value).__name__} of {len(value)} items>"
    return clip(ascii(value) if isinstance(value, str) else repr(value), limit)


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text``, cut to ``limit`` characters with a note of how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


# -- authentication and content type ----------------------------------------------------------

def check_api_key(headers: Any, api_key: str | None) -> None:
    """401 unless ``Authorization: Bearer <api_key>`` (when a key is set). Compared in constant time."""
    if api_key is None:
        return
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "replace"),
                                                            api_key.encode()):
        raise RequestError("invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", status=401, headers={"WWW-Authenticate": "Bearer"})


def check_content_type(headers: Any) -> None:
    """415 unless the body is declared ``application/json`` (parameters such as charset allowed)."""
    media = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        shown = quote(media) if media else "none"
        raise RequestError(f"the request body must be sent as Content-Type: application/json (got {shown})",
                           code="unsupported_media_type", status=415)


# -- admission (back-pressure) -------------------------------------------------------------------

class Admission:
    """Counts requests between admission and their arrival in the engine (tokenizing,
    validating); with ``AsyncLLM.num_in_flight`` (the engine's own requests: running or
    waiting) that is every request the server has taken on. Past ``capacity`` -> 429."""

    def __init__(self, llm: Any, max_num_seqs: int, max_queued_requests: int | None):
        self.llm = llm
        self.capacity = None if max_queued_requests is None else max_num_seqs + max_queued_requests
        self.pending = 0  # event loop only

    def in_flight(self) -> int:
        return self.pending + self.llm.num_in_flight

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold an admission slot until the request is in the engine (or refused)."""
        if self.capacity is not None and self.in_flight() >= self.capacity:
            raise RequestError(f"the server is at capacity ({self.capacity} requests running or queued): retry "
                               f"after {RETRY_AFTER_S} s", code="queue_full", status=429, type_="rate_limit_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1


# -- the body ------------------------------------------------------------------------------------

async def read_body(request: Any, limit: int, drain: int = DRAIN_BYTES) -> bytes:
    """The request body, or 413 once it is known to be larger than ``limit`` bytes.

    Past the limit nothing more is kept: up to ``drain`` bytes more are read and dropped,
    so that the client (still sending) reads its 413 rather than a reset connection, and
    the connection stays usable; a body larger still is answered at once (from its
    Content-Length, before reading anything) and the connection closed."""
    declared = request.headers.get("content-length")
    n = None
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise BadRequest("the Content-Length header is not an integer", code="invalid_request") from None
        if n > limit + drain:
            raise _too_large(limit, f"{n} bytes", close=True)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + drain:
            raise _too_large(limit, "more", close=True)
        if size <= limit and (n is None or n <= limit):
            chunks.append(chunk)
    if size > limit:
        raise _too_large(limit, f"{size} bytes")
    return b"".join(chunks)


def _too_large(limit: int, got: str, close: bool = False) -> RequestError:
    return RequestError(f"the request body is larger than this server's limit of {limit} bytes (got {got}); "
                        "shorten the prompt (the model's context bounds it anyway)", code="request_too_large",
                        status=413, headers={"Connection": "close"} if close else None)


def load_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a body: 400 (code ``invalid_json``) for bad JSON, nesting deeper than
    ``max_depth``, or integers past CPython's digit limit; ``check_strings`` next."""
    try:
        data = json.loads(raw)
    except RecursionError:  # nesting deeper than the parser's recursion: a client's mistake, not the engine's
        raise BadRequest(f"the request body nests deeper than {max_depth} levels", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {clip(str(e), 200)}", code="invalid_json") from None
    except ValueError:  # int() past sys.get_int_max_str_digits(): say so without CPython's wording
        raise BadRequest("the request body holds a number with too many digits", code="invalid_json") from None
    check_strings(data, max_depth)
    return data


def check_strings(data: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a parsed body (no recursion): 400 if it nests deeper than ``max_depth`` or any
    key or string is not valid Unicode text (a lone surrogate, from an escape like \\ud800)."""
    if isinstance(data, str):
        check_text(data, None)
    if not isinstance(data, (dict, list)):
        return
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        obj, depth, path = stack.pop()
        if depth > max_depth:
            raise BadRequest(f"the request body nests deeper than {max_depth} levels", _param(path), "invalid_json")
        for key, value in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            if isinstance(key, str):
                check_text(key, path)
            if isinstance(value, str):
                check_text(value, (*path, key))
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, (*path, key)))


def check_text(text: str, path: tuple | None, what: str = "text") -> None:
    """400 if ``text`` cannot be encoded as UTF-8 (it holds a lone surrogate)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _where(path)
        raise BadRequest(f"{where + ': ' if where else ''}the {what} holds an invalid code point "
                         f"(U+{ord(text[e.start]):04X}, a lone surrogate, at character {e.start}): send valid "
                         "Unicode text", _param(path), "invalid_text") from None


def _param(path: tuple | None) -> str | None:
    return clip(str(path[0]), MAX_QUOTE_CHARS) if path else None


def _where(path: tuple | None) -> str:
    if not path:
        return ""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return clip(ascii(out)[1:-1] if not out.isascii() else out, MAX_QUOTE_CHARS)


__all__ = ["ServerLimits", "RequestError", "BadRequest", "Admission", "quote", "clip", "check_api_key",
           "check_content_type", "read_body", "load_json", "check_strings", "check_text", "DEFAULT_MAX_BODY_BYTES",
           "MAX_JSON_DEPTH"]
