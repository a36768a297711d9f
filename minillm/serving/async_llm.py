"""``AsyncLLM``: the engine's step loop in a background thread, requests as async streams.

    llm = AsyncLLM.from_config(engine="paged", max_num_seqs=8)   # same options as LLM(...)
    async for out in llm.generate("The capital of France is", SamplingParams(max_tokens=8)):
        print(out.text, end="")          # the text this step added (out.token_ids: its tokens)
    llm.shutdown()

Why a thread, and why only that thread touches the engine: ``engine.step()`` is one
long blocking call (a forward pass; torch releases the GIL while it computes). Run on
the event loop, it would freeze every other connection for the step's duration. So the
engine lives in one thread, which owns it completely: adding a request (validating,
queueing), aborting one and stepping all happen there, *between* steps, in the order
they were asked for. The asyncio side only posts commands to that thread and reads each
request's outputs from its stream, which the engine thread fills through
``loop.call_soon_threadsafe`` (the one thread-safe way into an event loop). A consumer
that falls behind finds its new outputs merged into one (``RequestStream``): a reader
that stops reading holds one pending output, not one per step.

Tokenizing is the one part of adding a request that grows with what the client sent, so
it runs before the engine thread sees the request: text prompts and conversations go
through ``PromptEncoder`` (``encoder.py``: a worker thread with a tokenizer of its own;
fast tokenizers are not safe to call from two threads at once), which also refuses early
what could never fit the context. A huge prompt never delays a step.

    event loop(s)          tokenizer thread      engine thread
    add_request(prompt) --> encode(prompt) ----> make_request(ids), scheduler.add
                                                 step(); step(); ...
    stream             <--call_soon_threadsafe-- new tokens + new text of each request
    consumer cancelled --abort command---------> engine.abort(request): its KV blocks freed

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
from ..metrics import EngineSnapshot
from ..request import Request
from ..sampling_params import SamplingParams
from .encoder import PromptEncoder, chat_prompt_ids

# A params factory gets the prompt's token count and returns the SamplingParams: the
# server uses it to default max_tokens to the room left in the context, which it can only
# know once the prompt is tokenized (in the engine thread).
ParamsFactory = Callable[[int], SamplingParams]


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or a step failed): no request can be served."""


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
    """One request's outputs, as an async iterator. ``abort()`` stops the request.

    Outputs the consumer has not taken yet are merged as they arrive (``pending``): a
    consumer that stops reading holds one output with every token since, never a queue
    that grows by one entry per step.
    """

    def __init__(self, llm: "AsyncLLM", request_id: str):
        self.llm = llm
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.pending: StreamOutput | BaseException | None = None  # event loop only: what has not been taken
        self._texts: list[str] = []  # text merged into ``pending`` since, joined when it is taken
        self._ready = asyncio.Event()
        self.request: Request | None = None  # set by the engine thread once added
        self.cancelled = False  # aborted before the engine thread added it
        self.sent = 0  # output tokens handed out so far (engine thread's counter)
        self.done = False  # the final output (or an error) has been taken by the consumer

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        if self.done:
            raise StopAsyncIteration
        while self.pending is None:
            self._ready.clear()
            await self._ready.wait()
        out, self.pending = self.pending, None
        if self._texts:
            out.text += "".join(self._texts)
            self._texts = []
        if isinstance(out, BaseException):
            self.done = True
            raise out
        if out.finished:
            self.done = True
        return out

    def _push(self, out: StreamOutput | BaseException) -> None:
        """On the event loop: one more output (or the error that ends the stream)."""
        held = self.pending
        if isinstance(held, BaseException):
            pass  # the stream has failed already: that is what its consumer gets
        elif held is None or isinstance(out, BaseException):  # an error replaces what waits
            self.pending = out
            self._texts = []
        else:  # merged in place (the held output is this stream's alone until taken): O(new tokens)
            held.token_ids.extend(out.token_ids)
            self._texts.append(out.text)
            held.num_prompt_tokens, held.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
            held.finished, held.finish_reason, held.output = out.finished, out.finish_reason, out.output
        self._ready.set()

    def abort(self) -> None:
        """Stop the request (if it still runs) and free its KV blocks, from any thread. Idempotent.
        The consumer is done with the stream: iterating it ends."""
        if not self.done:
            self.done = True
            self.llm._submit(lambda: self.llm._abort_stream(self))

    def finish_early(self) -> None:
        """Abort the request but keep the stream: its consumer still gets the final output
        (finish_reason "abort", the text so far). From any thread; a no-op once finished."""
        if not self.done:
            self.llm._submit(lambda: self.llm._abort_stream(self))


class AsyncLLM:
    """An asyncio front over one ``LLMEngine``; its step loop runs in a background thread.

    ``counts``: requests added, and finished by reason ("stop", "length", "abort",
    "error"), kept by the engine thread: every request it accepted ends in exactly one.

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
        self.counts: dict[str, int] = {"added": 0}  # engine thread: added, then finished by reason
        self.encoder = PromptEncoder(engine.tokenizer, engine.max_model_len)
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
        arrival = self.engine.clock.now()  # the request's clock starts now: tokenizing counts in its TTFT
        text = None
        if self.encoder.tokenizer is not None and (messages is not None or isinstance(prompt, str)):
            # Off the step loop: the engine thread gets token ids (see encoder.py).
            text, prompt = await self.encoder.encode(prompt, messages)
            messages = None
            self._check_running()
        elif isinstance(prompt, (list, tuple)):
            self.encoder.check_ids(prompt)
        stream = RequestStream(self, request_id or f"req-{uuid.uuid4().hex[:16]}")
        accepted: asyncio.Future = stream.loop.create_future()

        def add() -> None:
            try:
                if stream.cancelled:
                    raise asyncio.CancelledError()
                self._add(stream, prompt, messages, sampling_params, arrival, priority, text)
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
        """Requests in the engine (running or waiting) that have not finished yet."""
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        """True while the loop serves requests: not shut down, and no step has failed."""
        return self._thread.is_alive() and not self._stopping and self._error is None

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
        self.encoder.close()
        self.engine.close()  # a tensor-parallel engine's workers

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
            raise EngineDeadError("this AsyncLLM has been shut down")
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}") from self._error

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
             priority: Any, text: str | None = None) -> None:
        engine = self.engine
        if stream.request_id in self._streams:
            raise ValueError(f"request_id {stream.request_id!r} is already in flight: give a unique id")
        if messages is not None:  # only without a tokenizer (the encoder did the rest): raises, saying so
            prompt = chat_prompt_ids(engine.tokenizer, messages)
        if callable(params):
            prompt_text, prompt = engine.tokenize(prompt)  # the factory needs the prompt's length; tokenize once
            text = text if prompt_text is None else prompt_text
            params = params(len(prompt))
        kwargs = {"priority": priority} if priority is not None else {}
        req = engine.make_request(prompt, params, arrival_time=arrival, request_id=stream.request_id, **kwargs)
        if text is not None:
            req.prompt = text
        engine.scheduler.add(req)
        stream.request = req
        self._streams[stream.request_id] = stream
        self.counts["added"] += 1

    def _abort_stream(self, stream: RequestStream, error: BaseException | None = None) -> None:
        stream.cancelled = True
        req = stream.request
        if req is None or self._streams.get(stream.request_id) is not stream:
            return  # never added, or already finished and handed out
        del self._streams[stream.request_id]
        self.engine.abort(req)  # frees its KV blocks; its text so far is kept
        self._count("error" if error is not None else "abort")
        final = error if error is not None else self._output(stream, req)
        _call_soon(stream.loop, stream._push, final)

    def _count(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def _publish(self) -> None:
        """Hand each request's new tokens and text to its consumer: one wake-up per loop per step."""
        by_loop: dict[Any, list] = {}
        for stream in list(self._streams.values()):
            req = stream.request
            if len(req.output_token_ids) > stream.sent or req.is_finished:
                if req.is_finished:
                    del self._streams[stream.request_id]
                    self._count(str(req.finish_reason))
                by_loop.setdefault(stream.loop, []).append((stream, self._output(stream, req)))
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
    for stream, out in items:
        stream._push(out)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


__all__ = ["AsyncLLM", "RequestStream", "StreamOutput", "EngineDeadError", "chat_prompt_ids",
           "sampling_params_fields"]
