"""The server under hostile and abandoned traffic: each defect an adversarial run found has
a regression test here (each fails on the code before the guards).

    bad text (lone surrogates)       -> 400, the keep-alive connection stays usable
    deeply nested JSON               -> 400 (was 503 "the engine is not running")
    a body past --max-body-bytes     -> 413 before it is read; a huge prompt neither delays
                                        other requests' steps nor keeps the memory
    non-streaming client goes away   -> its request is aborted, its blocks freed
    a reader that stops reading      -> one pending output per request, not one per step
    back-pressure, API key, content type, bounded error messages, 404 for an unknown
    model, HEAD /health, no /docs, bounded SIGTERM, CLI values checked before the load

A tiny Llama with seeded weights and SmolLM2's tokenizer (loaded once) serves: the guards
see only HTTP, and each server starts in a fraction of a second.
"""
import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from minillm import EngineConfig, ModelConfig, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
TINY = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
MAX_MODEL_LEN = 4096
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def tokenizer():
    from minillm.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def make_server(tokenizer):
    """``make_server(max_num_seqs=..., **limits)`` -> a running server (stopped at the module's end)."""
    from minillm.engine import build_engine
    from minillm.serving.async_llm import AsyncLLM
    from minillm.serving.server import serve_in_background

    handles = []

    def make(max_num_seqs=4, **limits):
        config = EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
                              max_num_seqs=max_num_seqs)
        llm = AsyncLLM(build_engine(config, model_config=TINY, tokenizer=tokenizer))
        kwargs = {}
        if limits:
            from minillm.serving.guards import ServerLimits

            kwargs["limits"] = ServerLimits(**limits)
        handle = serve_in_background(async_llm=llm, **kwargs)
        handles.append(handle)
        return handle

    yield make
    for h in handles:
        h.stop()
        h.llm.shutdown()


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()  # the defaults: 1 MiB bodies, no queue limit, no API key


def post(url, body, route="completions", headers=JSON, timeout=60):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{url}/v1/{route}", content=content, headers=headers, timeout=timeout)


def wait_idle(llm, timeout=10.0):
    """Until no request is in flight, queued or running, and every KV block is free; the seconds it took."""
    bm = llm.engine.scheduler.block_manager
    sched = llm.engine.scheduler
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not llm.num_in_flight and not sched.running and not sched.waiting and bm.num_free_blocks == bm.num_blocks:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"not idle after {timeout} s: in flight {llm.num_in_flight}, running {len(sched.running)}, "
                         f"waiting {len(sched.waiting)}, free blocks {bm.num_free_blocks}/{bm.num_blocks}")


def assert_error(r, status, code=None):
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert "Traceback" not in r.text
    if code is not None:
        assert err["code"] == code, err
    return err


# -- 1. bad text ---------------------------------------------------------------------------------

SURROGATES = [
    ("completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("completions", '{"prompt": ["a\\udfffb"], "max_tokens": 2}', "prompt"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', "messages"),
    ("chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages"),
    ("completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("completions", '{"prompt": "hi", "model": "x\\ud800", "max_tokens": 2}', "model"),
    ("completions", '{"prompt": "hi", "\\ud800": 1}', None),
]


@pytest.mark.parametrize("route, raw, param", SURROGATES, ids=[f"{i}-{s[2]}" for i, s in enumerate(SURROGATES)])
def test_a_lone_surrogate_is_a_400_and_the_connection_stays_open(server, route, raw, param):
    """Before: 500 from the tokenizer (TextEncodeInput must be Union[...]) and the keep-alive
    connection closed under the client."""
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("POST", f"/v1/{route}", body=raw.encode(), headers=JSON)
        r = conn.getresponse()
        data = json.loads(r.read())
        assert r.status == 400, data
        assert data["error"]["code"] == "invalid_text" and "surrogate" in data["error"]["message"]
        assert data["error"]["param"] == param
        sock = conn.sock
        assert sock is not None and not r.will_close  # the server kept the connection open
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 2}), headers=JSON)
        r2 = conn.getresponse()
        assert r2.status == 200 and json.loads(r2.read())["usage"]["completion_tokens"] == 2
        assert conn.sock is sock  # the same connection served the next request
    finally:
        conn.close()


def test_async_llm_rejects_a_lone_surrogate_with_a_value_error(server):
    async def main():
        for prompt, messages in (("a\ud800b", None), (None, [{"role": "user", "content": "\udc80"}])):
            with pytest.raises(ValueError, match="surrogate"):
                await server.llm.add_request(prompt, SamplingParams(max_tokens=2), messages=messages)

    asyncio.run(main())
    wait_idle(server.llm)


# -- 2. errors are classified by where they arise ------------------------------------------------

@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_a_400_not_an_engine_failure(server, depth):
    """Before: 100,000 levels -> RecursionError, taken for an engine failure: 503 'the engine
    is not running' while /health said ok."""
    r = post(server.url, '{"prompt": ' + "[" * depth + "]" * depth + "}")
    err = assert_error(r, 400, "invalid_json")
    assert "nests deeper" in err["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert post(server.url, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_bug_while_adding_a_request_is_a_500_and_the_engine_stays_up(server, monkeypatch):
    """Only a real engine failure is a 503 (and then /health says so): a RuntimeError raised
    while one request is added is that request's 500, and the engine keeps serving."""
    engine = server.llm.engine
    original = engine.make_request

    def broken(*args, **kwargs):
        monkeypatch.setattr(engine, "make_request", original)  # only this once
        raise RuntimeError("a bug while adding a request")

    monkeypatch.setattr(engine, "make_request", broken)
    r = post(server.url, {"prompt": "hi", "max_tokens": 2})
    assert_error(r, 500)
    assert "a bug while adding" not in r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert post(server.url, {"prompt": "hi", "max_tokens": 2}).status_code == 200


# -- 3. bounded bodies, tokenizing off the step loop ---------------------------------------------

def test_a_body_past_the_limit_is_a_413_before_it_is_read(server):
    """Before: no limit; the whole body was read, parsed and tokenized in the engine thread."""
    big = json.dumps({"prompt": "x " * (1 << 20), "max_tokens": 2})  # 2 MiB, the default limit is 1 MiB
    t0 = time.monotonic()
    err = assert_error(post(server.url, big), 413, "request_too_large")
    assert "1048576" in err["message"] and time.monotonic() - t0 < 5

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(64):
            yield b" " * 65536
        yield big.encode()

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=JSON, timeout=60)
    assert_error(r, 413, "request_too_large")
    # 50 MB declared: answered from the header alone, before a byte of the body is read
    u = urlsplit(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 52428800\r\n\r\n{\"prompt\": \"")
        head = sock.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413") and "connection: close" in head.lower(), head[:300]
    assert post(server.url, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_huge_prompt_delays_no_step_and_its_memory_returns(make_server):
    """An 8 MB prompt (1.4 M tokens) under a raised body limit: refused with a 400 in well
    under a second, while another request's stream keeps its pace, and the server's memory
    comes back. Before: tokenized in the engine thread (seconds; every step waited)."""
    psutil = pytest.importorskip("psutil")
    srv = make_server(max_body_bytes=64 << 20)
    proc = psutil.Process()
    gaps, first = [], threading.Event()

    def stream():
        body = {"prompt": "hi", "max_tokens": 1200, "ignore_eos": True, "stream": True}
        last = None
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    first.set()

    rss_before = proc.memory_info().rss
    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    t0 = time.monotonic()
    r = post(srv.url, {"prompt": "the history of computing " * 350_000, "max_tokens": 2})
    refused_in = time.monotonic() - t0
    err = assert_error(r, 400)
    assert "max_model_len" in err["message"] and len(err["message"]) < 400
    # 600 kB (150 k tokens): under the byte bound, so tokenized in full, in the encoder's thread
    err = assert_error(post(srv.url, {"prompt": "the history of computing " * 24_000, "max_tokens": 2}), 400)
    assert "prompt has 96001 tokens" in err["message"]
    t0 = time.monotonic()
    assert post(srv.url, {"prompt": "hi", "max_tokens": 1}).status_code == 200
    small_in = time.monotonic() - t0
    t.join(60)
    assert refused_in < 2.0 and small_in < 1.0, (refused_in, small_in)
    assert gaps and max(gaps) < 0.75, max(gaps)  # no step waited for the tokenizer
    assert proc.memory_info().rss - rss_before < 300e6, (proc.memory_info().rss - rss_before) / 1e6
    wait_idle(srv.llm)


def test_prompts_are_tokenized_off_the_engine_thread(server):
    """The tokenizer runs in the encoder's worker thread, never in the engine's step loop."""
    enc = server.llm.encoder
    threads = []
    original = type(enc.tokenizer).__call__

    class Spy(type(enc.tokenizer)):
        def __call__(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return original(self, *args, **kwargs)

    enc.tokenizer.__class__ = Spy
    try:
        assert post(server.url, {"prompt": "The capital of France is", "max_tokens": 2}).status_code == 200
    finally:
        enc.tokenizer.__class__ = Spy.__mro__[1]
    assert threads and all(name.startswith("minillm-tokenize") for name in threads), threads
    assert server.llm._thread.name not in threads


# -- 4. every disconnect aborts ----------------------------------------------------------------

def test_abandoned_non_streaming_requests_are_aborted_and_free_their_blocks(server, monkeypatch):
    """Three clients give up after 1 s on long requests (one a chat with the default
    max_tokens: to the end of the context). Before: they ran on, KV blocks growing."""
    llm = server.llm
    aborted = []  # (output tokens, blocks held after the abort)
    original = llm.engine.abort

    def spy(request):
        original(request)
        aborted.append((request.num_output_tokens, list(request.block_ids)))

    monkeypatch.setattr(llm.engine, "abort", spy)

    def give_up(route, body):
        with pytest.raises(httpx.TimeoutException):
            post(server.url, body, route, timeout=1.0)

    bodies = [("completions", {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}),
              ("completions", {"prompt": "Tell me a story.", "max_tokens": 4000, "ignore_eos": True}),
              ("chat/completions", {"messages": [{"role": "user", "content": "Tell me everything."}],
                                    "ignore_eos": True})]
    threads = [threading.Thread(target=give_up, args=b) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wait_idle(llm, timeout=10) < 3.0  # aborted within moments of the disconnect, not run to the end
    assert len(aborted) == 3 and all(0 < n < 4000 and blocks == [] for n, blocks in aborted), aborted


def test_a_reader_that_stops_reading_holds_one_pending_output(server):
    """The engine keeps generating for a consumer that does not read; what waits for it is
    one merged output, not one queued per step. Before: an asyncio.Queue, one entry a step."""
    llm = server.llm

    async def main():
        stream = await llm.add_request("hi", SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        while not stream.request.is_finished:  # generate all 300 tokens without reading one
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        assert stream.pending is not None and stream.pending.finished
        assert len(stream.pending.token_ids) == 300 and stream.pending.num_output_tokens == 300
        outs = [o async for o in stream]
        assert len(outs) == 1 and outs[0].output.token_ids == outs[0].token_ids
        assert outs[0].text == outs[0].output.text and outs[0].finish_reason == "length"

    asyncio.run(main())
    wait_idle(llm)


def test_a_stalled_stream_client_holds_no_blocks_and_is_cleaned_up(server):
    """A raw client asks for a long stream and never reads: the request still ends (its
    blocks are freed when it finishes) and closing the socket leaves nothing behind."""
    u = urlsplit(server.url)
    llm = server.llm
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((u.hostname, u.port))
    body = json.dumps({"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        time.sleep(0.5)
        wait_idle(llm, timeout=30)  # the request finished although its client read nothing
        pending = [s.pending for s in server.app.state.active]
        assert all(p is None or not isinstance(p, list) for p in pending)
    finally:
        sock.close()
    deadline = time.monotonic() + 10
    while server.app.state.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.app.state.active


# -- 5. back-pressure, API key, content type, bounded messages, small fixes --------------------

def test_a_full_queue_is_a_429_with_retry_after_and_loadgen_counts_it(make_server):
    from minillm.bench.loadgen import format_table, run_load

    srv = make_server(max_num_seqs=2, max_queued_requests=1)
    res = run_load(srv.url, rate=float("inf"), num_requests=10, output_tokens=200, seed=0)
    s = res.summary()
    assert s["num_rejected"] >= 1 and s["num_ok"] >= 3 and s["num_ok"] + s["num_rejected"] == 10, res.errors
    assert any("HTTP 429" in e for e in res.errors) and "429" in format_table(res).splitlines()[0]
    # and the header, on a request sent while the engine is full
    bodies = [{"prompt": "hi", "max_tokens": 400, "ignore_eos": True}] * 4

    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[c.post(srv.url + "/v1/completions", json=b) for b in bodies])

    rs = asyncio.run(burst())
    full = [r for r in rs if r.status_code == 429]
    assert full and all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in full)
    assert sum(r.status_code == 200 for r in rs) == 3
    wait_idle(srv.llm)


def test_api_key_is_required_on_v1_routes(make_server):
    from minillm.bench.loadgen import run_load

    srv = make_server(api_key="s3cret")
    body = {"prompt": "hi", "max_tokens": 2}
    assert_error(post(srv.url, body), 401, "invalid_api_key")
    assert_error(post(srv.url, body, headers={**JSON, "Authorization": "Bearer wrong"}), 401)
    assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401
    ok = post(srv.url, body, headers={**JSON, "Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # probes stay open
    assert httpx.get(srv.url + "/metrics", timeout=10).status_code == 200
    res = run_load(srv.url, rate=float("inf"), num_requests=2, output_tokens=2, api_key="s3cret")
    assert res.summary()["num_ok"] == 2, res.errors


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_post_needs_application_json(server, content_type):
    """A web page can make a browser send these cross-origin without a preflight."""
    headers = {} if content_type is None else {"content-type": content_type}
    assert_error(post(server.url, {"prompt": "hi", "max_tokens": 2}, headers=headers), 415, "unsupported_media_type")


def test_application_json_with_a_charset_is_accepted(server):
    r = post(server.url, {"prompt": "hi", "max_tokens": 2}, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


def test_error_messages_quote_a_bounded_prefix_of_the_input(server):
    """Before: a 600 kB stop list came back whole in the 400; a 5000-digit integer came back
    with CPython's set_int_max_str_digits advice."""
    cases = [
        ({"prompt": "hi", "stop": ["x" * 10] * 50_000 + [""]}, "stop"),
        ('{"prompt": "hi", "seed": ' + "9" * 5000 + "}", None),
        ({"prompt": "hi", "k" * 200_000: 1}, None),
        ({"prompt": "hi", "model": "m" * 200_000}, None),
        ({"prompt": "hi", "priority": "p" * 200_000}, None),
    ]
    for body, mention in cases:
        r = post(server.url, body)
        assert 400 <= r.status_code < 500, r.text[:300]
        assert len(r.content) < 2000, (r.status_code, r.text[:300])
        msg = r.json()["error"]["message"]
        assert "set_int_max_str_digits" not in msg and "4300" not in msg
        if mention:
            assert mention in msg


def test_an_unknown_model_is_a_404_model_not_found(server):
    r = post(server.url, {"prompt": "hi", "model": "gpt-4"})
    err = assert_error(r, 404, "model_not_found")
    assert err["param"] == "model" and "gpt-4" in err["message"]


def test_head_health_is_200_and_docs_are_off(server):
    r = httpx.head(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b""
    for path in ("/docs", "/redoc"):
        assert httpx.get(server.url + path, timeout=10).status_code == 404  # no page that loads a CDN's scripts


# -- bounded shutdown, and the command line --------------------------------------------------------

SERVE_TINY = textwrap.dedent("""
    import sys, time
    from minillm import EngineConfig, ModelConfig
    from minillm.engine import build_engine
    from minillm.serving import cli
    from minillm.serving.async_llm import AsyncLLM

    TINY = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=32)

    def tiny_llm(**kwargs):  # serve's engine, with tiny weights and a slowed step
        engine = build_engine(EngineConfig(engine="paged", device="cpu", dtype="float32",
                                           max_model_len=kwargs["max_model_len"]), model_config=TINY)
        step = engine.step

        def slow_step():
            time.sleep(0.01)
            return step()

        engine.step = slow_step
        return AsyncLLM(engine)

    AsyncLLM.from_config = staticmethod(tiny_llm)
    sys.exit(cli.main(sys.argv[1:]))
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_aborts_requests_in_flight_and_exits_within_seconds(tmp_path):
    """``python -m minillm serve`` (tiny weights) with a stream and a non-streaming request
    of 4000 tokens each in flight (~50 s of work): SIGTERM -> both end with finish_reason
    "abort" after the grace period (3 s) and the process exits within a few seconds.
    Before: uvicorn waited for them ("Waiting for background tasks to complete")."""
    script = tmp_path / "serve_tiny.py"
    script.write_text(SERVE_TINY)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(script), "--port", str(port), "--max-model-len", "4096",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = {}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.2)
        body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}
        first = threading.Event()

        def streaming():
            lines = []
            try:
                with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=90) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            first.set()
            except httpx.HTTPError as e:
                lines.append(f"error: {e!r}")
            results["stream"] = lines

        def plain():
            try:
                results["plain"] = post(url, body, timeout=90).json()
            except httpx.HTTPError as e:
                results["plain"] = f"error: {e!r}"

        threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert first.wait(30)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        exited_in = time.monotonic() - t0
        for t in threads:
            t.join(90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert exited_in < 8.0, f"the server took {exited_in:.1f} s to exit after SIGTERM"
    assert proc.returncode in (0, -signal.SIGTERM), proc.returncode
    events = results["stream"]
    assert events[-1] == "[DONE]", events[-3:]
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if e.startswith("{")]
    assert finishes[-1] == "abort"
    assert results["plain"]["choices"][0]["finish_reason"] == "abort", results["plain"]
    assert 0 < results["plain"]["usage"]["completion_tokens"] < 4000


@pytest.mark.parametrize("args, mention", [
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--max-queued-requests", "-2"], "--max-queued-requests"),
    (["--shutdown-grace", "nan"], "--shutdown-grace"),
    (["--host", "256.1.1.1"], "256.1.1.1"),
])
def test_serve_checks_its_values_before_loading_the_model(args, mention, capsys, monkeypatch):
    """Before: --port 70000 loaded the model (15 s), then printed an OverflowError traceback."""
    from minillm.__main__ import main
    from minillm.serving.async_llm import AsyncLLM

    def must_not_load(**kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(AsyncLLM, "from_config", staticmethod(must_not_load))
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and mention in err[0] and "Traceback" not in err[0], err


def test_serve_refuses_a_port_in_use_before_loading_the_model(capsys, monkeypatch):
    from minillm.__main__ import main
    from minillm.serving.async_llm import AsyncLLM

    monkeypatch.setattr(AsyncLLM, "from_config", staticmethod(lambda **kw: pytest.fail("the model was loaded")))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--port", str(busy.getsockname()[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot listen" in err[0], err


def test_api_key_comes_from_the_environment_too(monkeypatch):
    from minillm.serving.cli import _serve_parser, limits_from_args

    monkeypatch.setenv("MINILLM_API_KEY", "from-env")
    assert limits_from_args(_serve_parser().parse_args([])).api_key == "from-env"
    assert limits_from_args(_serve_parser().parse_args(["--api-key", "k"])).api_key == "k"
    monkeypatch.delenv("MINILLM_API_KEY")
    limits = limits_from_args(_serve_parser().parse_args([]))
    assert limits.api_key is None and limits.max_queued_requests is None and limits.max_body_bytes == 1 << 20
    assert os.environ.get("MINILLM_API_KEY") is None
