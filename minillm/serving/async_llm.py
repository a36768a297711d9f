"""``AsyncLLM``: the engine's step loop in a background thread, requests as async streams.

    llm = AsyncLLM.from_config(engine="paged", max_num_seqs=8)   # same options as LLM(...)
    async for out in llm.generate("The capital of France is", SamplingParams(max_tokens=8)):
        print(out.text, end="")          # the text this step added (out.token_ids: its tokens)
    llm.shutdown()

Why a thread, and why only that thread touches the engine: ``engine.step()`` is one
long blocking call (a forward pass; torch releases the GIL while it computes). Run on
the event loop, it would freeze every other connection for the step's duration. So the
engine lives in one thread, which owns it completely: adding a request (tokenizing,
validating, queueing), aborting one and stepping all happen there, *between* steps,
in the order they were asked for. The asyncio side only posts commands to that thread
and reads results from per-request ``asyncio.Queue`` s, which the engine thread fills
through ``loop.call_soon_threadsafe`` (the one thread-safe way into an event loop).
The tokenizer is used by that thread only, too (fast tokenizers are not safe to call
from two threads at once).

    event loop(s)                               engine thread
    add_request(prompt) --command-->            make_request, scheduler.add
                                                step(); step(); ...
    queue.get()        <--call_soon_threadsafe-- new tokens + new text of each request
    consumer cancelled --abort command-->       engine.abort(request): its KV blocks freed

The thread steps only while it has requests of its own in flight, so an engine shared
with offline code (``LLM.generate`` on the same ``LLMEngine``, run at another time) is
never stepped behind that code's back.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any, AsyncIterator, Callable, Sequence

from ..engine import LLMEngine, RequestOutput, build_engine
from ..inputs import parse_conversation
from ..metrics import EngineSnapshot
from ..request import Request
from ..sampling_params import SamplingParams

# A params factory gets the prompt's token count and returns the SamplingParams: the
# server uses it to default max_tokens to the room left in the context, which it can only
# know once the prompt is tokenized (in the engine thread).
ParamsFactory = Callable[[int], SamplingParams]


@dataclass(slots=True)
class StreamOutput:
    """What one request gained since its previous output (one step, or several merged).

    ``token_ids`` and ``text`` are deltas. ``text`` may be empty although tokens came: the
    detokenizer holds back an unfinished character or a possible stop string, and
    releases it later (never retracting what it released). The last output has
    ``finished=True``, the finish reason, and ``output``: the whole request.
    """

    request_id: str
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int  # so far, this output's tokens included
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    output: RequestOutput | None = None  # on the final output: text, token ids and metrics of the request


class RequestStream:
    """One request's outputs, as an async iterator. ``abort()`` stops the request."""

    def __init__(self, llm: "AsyncLLM", request_id: str):
        self.llm = llm
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request: Request | None = None  # set by the engine thread once added
        self.cancelled = False  # aborted before the engine thread added it
        self.sent = 0  # output tokens handed out so far (engine thread's counter)
        self.done = False  # the final output (or an error) has been taken by the consumer

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        if self.done:
            raise StopAsyncIteration
        out = await self.queue.get()
        # A slow consumer finds several outputs waiting: hand them out as one.
        while not self.queue.empty() and isinstance(out, StreamOutput) and not out.finished:
            out = _merge(out, self.queue.get_nowait())
        if isinstance(out, BaseException):
            self.done = True
            raise out
        if out.finished:
            self.done = True
        return out

    def abort(self) -> None:
        """Stop the request (if it still runs) and free its KV blocks, from any thread. Idempotent."""
        if not self.done:
            self.done = True
            self.llm._submit(lambda: self.llm._abort_stream(self))


def _merge(a: StreamOutput, b: Any) -> Any:
    if isinstance(b, BaseException):
        return b
    return StreamOutput(a.request_id, a.token_ids + b.token_ids, a.text + b.text, b.num_prompt_tokens,
                        b.num_output_tokens, b.finished, b.finish_reason, b.output)


class AsyncLLM:
    """An asyncio front over one ``LLMEngine``; its step loop runs in a background thread.

    ``stats`` is the engine's snapshot (``EngineSnapshot``: queues, KV blocks, counters),
    taken by the engine thread after each step; the server's ``/metrics`` reads it.
    ``engine`` is public too: tests read its scheduler and step records (reads from
    another thread see a state between two steps, or during one).
    ``keep_step_records`` bounds ``engine.step_records`` in a long-running server: when
    it grows past that, the oldest half is dropped.
    """

    def __init__(self, engine: LLMEngine, *, keep_step_records: int | None = 100_000):
        if not isinstance(engine, LLMEngine):
            raise ValueError(f"AsyncLLM needs an LLMEngine (e.g. LLM(...).engine), got {type(engine).__name__}")
        if keep_step_records is not None and (not isinstance(keep_step_records, int) or keep_step_records < 2):
            raise ValueError(f"keep_step_records must be None or an integer >= 2, got {keep_step_records!r}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.keep_step_records = keep_step_records
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._streams: dict[str, RequestStream] = {}  # engine thread only: requests in flight
        self._stopping = False
        self._error: BaseException | None = None  # a step that raised: every later request fails with it
        self._make_request_takes_priority = "priority" in inspect.signature(engine.make_request).parameters
        self.stats: EngineSnapshot = engine.snapshot()  # the engine's state after the last step
        self._thread = threading.Thread(target=self._loop, name="minillm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, **kwargs: Any) -> "AsyncLLM":
        """Build the engine from the same keyword options as ``LLM(...)`` (``EngineConfig``'s fields)."""
        from ..config import EngineConfig

        return cls(build_engine(EngineConfig.from_kwargs(**kwargs)))

    @classmethod
    def from_llm(cls, llm: Any) -> "AsyncLLM":
        """Serve the engine of an offline ``LLM`` (its weights already loaded). Do not call
        ``llm.generate`` while this AsyncLLM has requests in flight: one engine, one driver."""
        return cls(llm.engine)

    # -- the asyncio side ----------------------------------------------------------------
    async def add_request(self, prompt: str | Sequence[int] | None,
                          sampling_params: SamplingParams | ParamsFactory | None = None,
                          request_id: str | None = None, *, messages: list[dict] | None = None,
                          priority: Any = None) -> RequestStream:
        """Validate and queue one request; returns its stream once the engine has accepted it.

        ``prompt``: text or token ids; or ``messages`` (a conversation, rendered with the
        chat template) instead. ``sampling_params`` may be a function of the prompt's token
        count. Bad input raises ValueError here, before any output.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt (text or token ids) or messages (a conversation)")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if priority is not None and not self._make_request_takes_priority:
            raise ValueError("this engine has no request priorities: leave priority unset")
        self._check_running()
        stream = RequestStream(self, request_id or f"req-{uuid.uuid4().hex[:16]}")
        accepted: asyncio.Future = stream.loop.create_future()
        arrival = self.engine.clock.now()  # the request's clock starts now, not when the thread picks it up

        def add() -> None:
            try:
                if stream.cancelled:
                    raise asyncio.CancelledError()
                self._add(stream, prompt, messages, sampling_params, arrival, priority)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller, not swallowed
                _call_soon(stream.loop, _set_exception, accepted, e)
            else:
                _call_soon(stream.loop, _set_result, accepted, stream)

        self._submit(add)
        try:
            return await accepted
        except asyncio.CancelledError:
            # The caller went away before the engine answered: if the add still happens,
            # the abort queued behind it undoes it.
            stream.cancelled = True
            stream.abort()
            raise

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[StreamOutput]:
        """Stream one request's outputs. Cancelling the consumer (``aclose()``, task cancel,
        ``break``) aborts the request and frees its KV blocks."""
        stream = await self.add_request(prompt, sampling_params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                   request_id: str | None = None) -> AsyncIterator[StreamOutput]:
        """``generate`` for a conversation: the chat template is applied first."""
        stream = await self.add_request(None, sampling_params, request_id, messages=messages)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> bool:
        """Abort a request by id; True if it was still in flight. Its blocks are free on return."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def run() -> None:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._abort_stream(stream)
            _call_soon(loop, _set_result, done, stream is not None)

        self._submit(run)
        return await done

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread, between two steps; returns its result."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001
                _call_soon(loop, _set_exception, done, e)
            else:
                _call_soon(loop, _set_result, done, result)

        self._submit(run)
        return await done

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is in flight (e.g. after an abort, before checking blocks)."""
        deadline = time.monotonic() + timeout
        while True:
            if await self.call(lambda e: not self._streams and not e.has_unfinished()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still in flight after {timeout} s")
            await asyncio.sleep(0.005)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self) -> None:
        """Stop the loop thread; requests still in flight end with finish_reason "abort"."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        # The thread is gone: this thread owns the engine now.
        for cmd in self._commands:
            cmd()
        self._commands.clear()
        for stream in list(self._streams.values()):
            self._abort_stream(stream)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- the engine thread -----------------------------------------------------------
    def _submit(self, cmd: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping and not self._thread.is_alive():
                cmd()  # after shutdown: run here (an abort must still reach its stream)
                return
            self._commands.append(cmd)
            self._cond.notify()

    def _check_running(self) -> None:
        if self._stopping:
            raise RuntimeError("this AsyncLLM has been shut down")
        if self._error is not None:
            raise RuntimeError(f"the engine loop failed: {self._error!r}") from self._error

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._commands or self._stopping or (self._streams and engine.has_unfinished())):
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            for cmd in commands:
                cmd()
            if not (self._streams and engine.has_unfinished()):
                self.stats = engine.snapshot()
                continue
            num_records = len(engine.step_records)
            try:
                engine.step()
            except Exception as e:  # a bug in a step: fail every request in flight, keep the thread
                self._error = e
                for stream in list(self._streams.values()):
                    self._abort_stream(stream, error=e)
                continue
            if len(engine.step_records) == num_records:
                time.sleep(0.001)  # nothing was scheduled: do not spin on the GIL
            self._publish()
            self._trim_records()
            self.stats = engine.snapshot()

    def _add(self, stream: RequestStream, prompt: Any, messages: Any, params: Any, arrival: float,
             priority: Any) -> None:
        engine = self.engine
        if stream.request_id in self._streams:
            raise ValueError(f"request_id {stream.request_id!r} is already in flight: give a unique id")
        if messages is not None:
            prompt = chat_prompt_ids(engine.tokenizer, messages)
        text = None
        if callable(params):
            text, prompt = engine.tokenize(prompt)  # the factory needs the prompt's length; tokenize once
            params = params(len(prompt))
        kwargs = {"priority": priority} if priority is not None else {}
        req = engine.make_request(prompt, params, arrival_time=arrival, request_id=stream.request_id, **kwargs)
        if text is not None:
            req.prompt = text
        engine.scheduler.add(req)
        stream.request = req
        self._streams[stream.request_id] = stream

    def _abort_stream(self, stream: RequestStream, error: BaseException | None = None) -> None:
        stream.cancelled = True
        req = stream.request
        if req is None or self._streams.get(stream.request_id) is not stream:
            return  # never added, or already finished and handed out
        del self._streams[stream.request_id]
        self.engine.abort(req)  # frees its KV blocks; its text so far is kept
        final = error if error is not None else self._output(stream, req)
        _call_soon(stream.loop, stream.queue.put_nowait, final)

    def _publish(self) -> None:
        """Hand each request's new tokens and text to its consumer: one wake-up per loop per step."""
        by_loop: dict[Any, list] = {}
        for stream in list(self._streams.values()):
            req = stream.request
            if len(req.output_token_ids) > stream.sent or req.is_finished:
                if req.is_finished:
                    del self._streams[stream.request_id]
                by_loop.setdefault(stream.loop, []).append((stream.queue, self._output(stream, req)))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _output(self, stream: RequestStream, req: Request) -> StreamOutput:
        n = len(req.output_token_ids)
        new = req.output_token_ids[stream.sent:n]
        stream.sent = n
        text = req.detokenizer.new_text() if req.detokenizer is not None else ""
        out = StreamOutput(req.request_id, new, text, req.num_prompt_tokens, n)
        if req.is_finished:
            out.finished = True
            out.finish_reason = str(req.finish_reason)
            out.output = self.engine.output(req)
        return out

    def _trim_records(self) -> None:
        records, keep = self.engine.step_records, self.keep_step_records
        if keep is not None and len(records) > keep:
            del records[:len(records) - keep // 2]


def chat_prompt_ids(tokenizer: Any, messages: Any) -> list[int]:
    """A conversation -> the chat template's token ids, ready for the assistant's turn (as ``LLM.chat_prompt``)."""
    if tokenizer is None:
        raise ValueError("chat needs the tokenizer of the GGUF, which this engine does not have")
    messages = parse_conversation(messages)
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def sampling_params_fields() -> set[str]:
    """The fields this version of SamplingParams has (optional features are looked up, not assumed)."""
    return {f.name for f in fields(SamplingParams)}


# -- crossing from the engine thread into an event loop --------------------------------

def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop has closed: nobody is listening any more
        pass


def _deliver(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


__all__ = ["AsyncLLM", "RequestStream", "StreamOutput", "chat_prompt_ids", "sampling_params_fields"]
