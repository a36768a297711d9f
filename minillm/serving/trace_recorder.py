"""The traffic a server receives, written as a trace that the load generator replays.

    python -m minillm serve --record-trace traffic.jsonl      # real users hit it for a while
    python -m minillm load --trace traffic.jsonl --url http://127.0.0.1:8001   # replay on another config

One JSON line per completion or chat request, in the format ``python -m minillm load
--trace`` reads (``minillm.bench.loadgen.load_trace``):

    {"arrival": 0.0, "prompt": "The capital of France is", "output_tokens": 8, "max_tokens": 8, ...}
    {"arrival": 1.25, "messages": [{"role": "user", "content": "Hi"}], "output_tokens": 31, "max_tokens": null, ...}

``arrival``: seconds from the first request this server received (so a replay starts at
0); ``prompt``: the text or token ids as sent (one prompt), or ``messages``: the chat as
the server read it (text parts joined); ``output_tokens``: the tokens the request
actually produced, which is what a replay asks for (with ``ignore_eos``, the replay does
the same work even where the original stopped at an end-of-sequence token or a stop
string); ``max_tokens`` (what the client asked for, null for "to the end of the context")
and ``finish_reason`` are kept for the reader. A request aborted before its first token
is written with ``output_tokens`` 1: its prompt was still read and queued.

A line is written when its request ends (so the file is in order of completion; the
reader sorts by arrival) and flushed at once, so the file is a valid trace while the
server runs. Only requests the engine took are written: one refused before it (a bad
body, 400; the queue full, 429) did no work to replay.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable


class TraceRecorder:
    """Writes one trace line per request: ``start`` when the engine takes it, ``end`` when it ends.

    ``clock``: seconds, monotonic (``time.monotonic``; a test passes its own).
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"--record-trace {str(self.path)!r} is a directory: give a file path")
        if not self.path.parent.is_dir():
            raise ValueError(f"--record-trace {str(self.path)!r}: the directory {str(self.path.parent)!r} "
                             "does not exist")
        self.clock = clock
        self._file = self.path.open("w", encoding="utf-8")  # a new trace per server run
        self._lock = threading.Lock()
        self._t0: float | None = None
        self._open: dict[Any, dict[str, Any]] = {}  # stream -> its line, until it ends
        self.num_written = 0

    def arrived(self) -> float:
        """Seconds since the first request arrived (0.0 for the first): call when a request comes in."""
        now = self.clock()
        with self._lock:
            if self._t0 is None:
                self._t0 = now
            return max(0.0, now - self._t0)

    def start(self, stream: Any, arrival: float, prompt: Any = None, messages: Any = None,
              max_tokens: int | None = None) -> None:
        """The engine took ``stream``'s request, which arrived at ``arrival`` (``arrived()``)."""
        line: dict[str, Any] = {"arrival": round(arrival, 6)}
        if messages is not None:
            line["messages"] = messages
        else:
            line["prompt"] = prompt
        line["max_tokens"] = max_tokens
        with self._lock:
            self._open[stream] = line

    def end(self, stream: Any) -> None:
        """``stream``'s request ended (finished, aborted or failed): write its line. Idempotent."""
        with self._lock:
            line = self._open.pop(stream, None)
            if line is None or self._file.closed:
                return
            self._write(line, getattr(stream, "request", None))

    def _write(self, line: dict[str, Any], request: Any) -> None:
        produced = request.num_output_tokens if request is not None else 0
        reason = getattr(request, "finish_reason", None)
        line["output_tokens"] = max(1, produced)
        line["finish_reason"] = None if reason is None else str(getattr(reason, "value", reason))
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()
        self.num_written += 1

    def close(self) -> None:
        """Write the requests still open (as far as they got) and close the file. Idempotent."""
        with self._lock:
            if self._file.closed:
                return
            for stream, line in self._open.items():
                self._write(line, getattr(stream, "request", None))
            self._open.clear()
            self._file.close()


__all__ = ["TraceRecorder"]
