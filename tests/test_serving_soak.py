"""Soak: about a minute of mixed, partly hostile traffic against one server, then proof
that nothing was lost.

Traffic (Poisson arrivals, seeded; loopback only; every client has a timeout, and the
whole run a deadline, so it stops by itself):

    stream      greedy streaming completions, 8-48 tokens
    plain       greedy non-streaming completions
    chat        greedy chat completions, streaming or not
    slow        streams read one line every 50 ms
    drop        streams the client closes after 0-20 chunks
    timeout     non-streaming requests of 1500 tokens whose client gives up after 0.05-1 s
    stalled     raw sockets that ask for a stream, read nothing for 2 s, then close
    malformed   lone surrogates, 100,000-deep JSON, bad JSON, text/plain, an unknown
                model, a 2 MB body, 300 kB and 700 kB prompts, a 5000-digit number
    burst       60 requests at once, past the queue limit (8 running + 16 queued)

Every accepted request carries a tag in its prompt; a spy on the scheduler records what
reached the engine. Then: every request that reached the engine was sent by a client and
ended exactly once (finished, or aborted because its client left); every completed one
has exactly its tokens, and the text and tokens of the offline engine; every refused one
never reached it; the engine is empty (nothing running or waiting, every KV block free),
the server's memory is back within a bound and /health says ok. The figures (requests by
outcome, p99 latencies of the normal requests) are printed (``pytest -s``).

A tiny Llama with seeded weights and SmolLM2's tokenizer: the run is about its traffic,
not the model's arithmetic; ~70 s on 2 cores.
"""
import asyncio
import gc
import json
import random
import socket
import time
from collections import Counter
from urllib.parse import urlsplit

import httpx
import pytest

from minillm import EngineConfig, ModelConfig, SamplingParams
from minillm.bench.prompts import INSTRUCTIONS

pytestmark = pytest.mark.slow

TINY = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 8
MAX_QUEUED = 16
DURATION_S = 50.0  # of arrivals; the run ends when the last request has
DEADLINE_S = 180.0  # the whole run, however it goes
RATES = {"stream": 2.5, "plain": 1.5, "chat": 0.5, "slow": 0.3, "drop": 1.0, "timeout": 0.6, "malformed": 1.0}
NORMAL = ("stream", "plain", "chat")  # the steady traffic whose latency is reported (slow readers set their own pace)
JSON_CT = {"content-type": "application/json"}


def malformed_cases():
    """(body bytes, headers, expected status)."""
    j = lambda d: json.dumps(d).encode()  # noqa: E731
    return [
        (b'{"prompt": "a\\ud800b", "max_tokens": 4}', JSON_CT, 400),
        (b'{"messages": [{"role": "user", "content": "\\udc80"}]}', JSON_CT, 400),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON_CT, 400),
        (b'{"prompt": "hi", "max_tokens": ', JSON_CT, 400),
        (j({"prompt": "hi", "max_tokens": 4}), {"content-type": "text/plain"}, 415),
        (j({"prompt": "hi", "max_tokens": 4, "model": "gpt-4"}), JSON_CT, 404),
        (j({"prompt": "x " * (1 << 20), "max_tokens": 4}), JSON_CT, 413),
        (j({"prompt": "the history of computing " * 12_000, "max_tokens": 4}), JSON_CT, 400),  # tokenized: too long
        (j({"prompt": "the history of computing " * 28_000, "max_tokens": 4}), JSON_CT, 400),  # refused by its bytes
        (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", JSON_CT, 400),
        (j({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}), JSON_CT, 400),
    ]


@pytest.fixture(scope="module")
def served():
    from minillm.engine import build_engine
    from minillm.serving.async_llm import AsyncLLM
    from minillm.serving.guards import ServerLimits
    from minillm.serving.server import serve_in_background

    config = EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=MAX_NUM_SEQS)
    engine = build_engine(config, model_config=TINY)
    reached = {}  # request id -> Request: everything that reached the scheduler
    add = engine.scheduler.add

    def spy(request):
        reached.setdefault(request.request_id, request)
        add(request)

    engine.scheduler.add = spy
    llm = AsyncLLM(engine)
    handle = serve_in_background(async_llm=llm, limits=ServerLimits(max_queued_requests=MAX_QUEUED))
    yield handle, engine, reached
    handle.stop()
    llm.shutdown()


def _schedule(seed: int) -> list[tuple[float, str, int]]:
    rng = random.Random(seed)
    events = []
    for kind, rate in RATES.items():
        t = rng.expovariate(rate)
        while t < DURATION_S:
            events.append((t, kind))
            t += rng.expovariate(rate)
    events += [(DURATION_S / 2, "burst")] * 60
    events += [(5.0 + 15.0 * k, "stalled") for k in range(3)]
    events.sort(key=lambda e: e[0])
    return [(t, kind, i) for i, (t, kind) in enumerate(events)]


async def _client(c: httpx.AsyncClient, url: str, t0: float, t: float, kind: str, i: int,
                  rng: random.Random) -> dict:
    await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
    rec = {"i": i, "kind": kind, "tag": f"[{i}]", "status": None, "outcome": None}
    prompt = f"[{i}] {INSTRUCTIONS[i % len(INSTRUCTIONS)]}"
    n = rng.randint(8, 48)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    sent = time.perf_counter()
    if True:
        try:
            if kind == "malformed":
                raw, headers, expected = malformed_cases()[i % len(malformed_cases())]
                r = await c.post(url + "/v1/completions", content=raw, headers=headers)
                rec.update(status=r.status_code, expected=expected, outcome="refused",
                           body_len=len(r.content), error=r.json()["error"])
            elif kind in ("plain", "burst") or (kind == "chat" and i % 2):
                route = "completions"
                if kind == "chat":
                    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0,
                            "ignore_eos": True}
                    route, n = "chat/completions", 16
                r = await c.post(f"{url}/v1/{route}", json=body)
                rec["status"] = r.status_code
                if r.status_code == 200:
                    d = r.json()
                    ch = d["choices"][0]
                    rec.update(outcome="completed", n=n, e2e=time.perf_counter() - sent, finish=ch["finish_reason"],
                               text=ch["message"]["content"] if kind == "chat" else ch["text"],
                               tokens=d["usage"]["completion_tokens"])
                else:
                    rec.update(outcome="refused", error=r.json()["error"], retry_after=r.headers.get("retry-after"))
            elif kind in ("stream", "slow", "drop", "chat"):
                route = "completions"
                if kind == "chat":
                    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0,
                            "ignore_eos": True}
                    route, n = "chat/completions", 16
                if kind == "drop":
                    body["max_tokens"] = 400
                    drop_after = rng.randint(0, 20)
                body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                text, usage, finish, ttft, chunks = [], None, None, None, 0
                async with c.stream("POST", f"{url}/v1/{route}", json=body) as r:
                    rec["status"] = r.status_code
                    if r.status_code != 200:
                        rec.update(outcome="refused", error=json.loads(await r.aread())["error"],
                                   retry_after=r.headers.get("retry-after"))
                        return rec
                    async for line in r.aiter_lines():
                        if kind == "drop" and chunks >= drop_after:
                            rec.update(outcome="disconnected", chunks=chunks)
                            return rec  # leaving the block closes the connection mid-stream
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        d = json.loads(line[6:])
                        chunks += 1
                        if d.get("usage"):
                            usage = d["usage"]
                        for ch in d["choices"]:
                            piece = (ch["delta"].get("content") or "") if kind == "chat" else ch["text"]
                            if ttft is None and (piece or ch["finish_reason"]):
                                ttft = time.perf_counter() - sent  # the first token's text, not the role chunk
                            text.append(piece)
                            finish = ch["finish_reason"] or finish
                        if kind == "slow":
                            await asyncio.sleep(0.05)
                rec.update(outcome="completed", n=n, text="".join(text), finish=finish, ttft=ttft,
                           e2e=time.perf_counter() - sent, tokens=usage["completion_tokens"] if usage else None)
            elif kind == "timeout":
                body["max_tokens"] = 1500
                try:
                    r = await c.post(url + "/v1/completions", json=body, timeout=rng.uniform(0.05, 1.0))
                    rec["status"] = r.status_code
                    if r.status_code == 200:
                        rec["outcome"] = "completed?"  # it beat its own timeout
                    else:
                        rec.update(outcome="refused", error=r.json()["error"], retry_after=r.headers.get("retry-after"))
                except httpx.TimeoutException:
                    rec.update(outcome="disconnected")
            elif kind == "stalled":
                await _stalled(url, body, rec)
        except httpx.HTTPError as e:
            rec.update(outcome="client-error", error=repr(e))
    return rec


async def _stalled(url: str, body: dict, rec: dict) -> None:
    """A raw client that asks for a stream, reads nothing for 2 s, then closes."""
    u = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (u.hostname, u.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    raw = json.dumps({**body, "max_tokens": 300, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
    await writer.drain()
    await asyncio.sleep(2.0)
    writer.close()
    rec.update(status=200, outcome="disconnected")


def _rss() -> int:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


def _p(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


def test_soak_nothing_lost(served):
    handle, engine, reached = served
    llm, url = handle.llm, handle.url
    # warm up (first steps, allocator, the tokenizer thread), then the memory baseline
    for _ in range(3):
        assert httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 8}, timeout=60).is_success
    warm = set(reached)
    rss_before = _rss()
    rng = random.Random(7)
    schedule = _schedule(seed=11)

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            t0 = time.perf_counter() + 0.1
            tasks = [asyncio.create_task(_client(c, url, t0, t, kind, i, random.Random(rng.random())))
                     for t, kind, i in schedule]
            return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

    t_start = time.monotonic()
    records = asyncio.run(main())
    wall = time.monotonic() - t_start

    # -- the engine is empty, the server healthy, its memory back ----------------------------
    sched, bm = engine.scheduler, engine.scheduler.block_manager
    deadline = time.monotonic() + 15
    while (llm.num_in_flight or sched.running or sched.waiting or bm.num_free_blocks != bm.num_blocks
           or handle.app.state.active) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.num_in_flight and not sched.running and not sched.waiting, (len(sched.running), len(sched.waiting))
    assert bm.num_free_blocks == bm.num_blocks, (bm.num_free_blocks, bm.num_blocks)
    assert not handle.app.state.active and handle.app.state.admission.pending == 0
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    grown = (_rss() - rss_before) / 1e6
    assert grown < 250, f"the process grew by {grown:.0f} MB"

    # -- every request that reached the engine was a client's and ended exactly once ---------------
    by_tag = {r["tag"]: r for r in records}
    in_engine = {}
    tokenizer = engine.tokenizer
    for rid, req in reached.items():
        if rid in warm:
            continue
        text = req.prompt if req.prompt is not None else tokenizer.decode(req.prompt_token_ids)
        tag = text[text.index("["):text.index("]") + 1]
        assert tag not in in_engine, f"{tag} reached the engine twice"
        in_engine[tag] = req
        assert req.is_finished, f"{tag} never ended"
    counts = Counter()
    for tag, req in in_engine.items():
        rec = by_tag[tag]
        reason = str(req.finish_reason)
        if rec["outcome"] == "completed":
            assert reason in ("length", "stop"), (rec, reason)
            assert rec["status"] == 200 and rec["finish"] == reason and rec["tokens"] == req.num_output_tokens, rec
            assert rec["tokens"] == rec["n"] or reason == "stop", rec  # exactly its tokens
            assert rec["text"] == req.output_text, (rec["text"], req.output_text)
            counts["completed"] += 1
        else:
            assert rec["outcome"] in ("disconnected", "completed?"), rec
            counts["aborted" if reason == "abort" else "ended before its client left"] += 1
    for rec in records:
        if rec["outcome"] == "refused":
            assert rec["tag"] not in in_engine or rec["kind"] == "malformed", rec  # refused: never reached it
            if rec["kind"] == "malformed":
                assert rec["status"] == rec["expected"] and rec["body_len"] < 2000, rec
            elif rec["status"] == 429:  # the burst's, or any request that came while the queue was full
                assert rec["retry_after"] == "1" and rec["error"]["code"] == "queue_full", rec
            else:
                raise AssertionError(f"a well-formed request was refused: {rec}")
        assert rec["outcome"] != "client-error", rec
        if rec["outcome"] == "completed":
            assert rec["tag"] in in_engine, rec
    aborted_by_engine = sum(str(r.finish_reason) == "abort" for r in in_engine.values())
    assert llm.counts["added"] == sum(v for k, v in llm.counts.items() if k != "added")  # each ended once
    assert counts["aborted"] == aborted_by_engine

    # -- greedy outputs equal the offline engine's -------------------------------------------------
    handle.stop()
    llm.shutdown()  # the engine thread is gone: this thread may drive the engine now
    completed = [req for tag, req in in_engine.items() if by_tag[tag]["outcome"] == "completed"]
    offline = engine.run([engine.make_request(list(r.prompt_token_ids),
                                              SamplingParams(temperature=0, max_tokens=r.sampling_params.max_tokens,
                                                             ignore_eos=True)) for r in completed])
    for req, ref in zip(completed, offline):
        assert list(req.output_token_ids) == ref.token_ids and req.output_text == ref.text, req.request_id

    # -- the figures ----------------------------------------------------------------------------------
    outcomes = Counter((r["kind"], r["outcome"] if r["status"] != 429 else "429") for r in records)
    normal = [r for r in records if r["kind"] in NORMAL and r["outcome"] == "completed"]
    ttft = [r["ttft"] for r in normal if r.get("ttft") is not None]
    e2e = [r["e2e"] for r in normal]
    print(f"\nsoak: {len(records)} requests in {wall:.0f} s; reached the engine {len(in_engine)}: {dict(counts)}; "
          f"engine counts {llm.counts}; rss {grown:+.0f} MB")
    for (kind, outcome), k in sorted(outcomes.items()):
        print(f"  {kind:10} {outcome:13} {k}")
    print(f"  normal requests: TTFT p50 {_p(ttft, 50):.3f} s p99 {_p(ttft, 99):.3f} s; "
          f"end-to-end p50 {_p(e2e, 50):.3f} s p99 {_p(e2e, 99):.3f} s ({len(normal)} requests)")
    assert counts["completed"] >= 150 and counts["aborted"] >= 40, counts
    assert outcomes[("burst", "429")] >= 1 and outcomes[("burst", "completed")] >= MAX_NUM_SEQS
    assert _p(ttft, 99) < 5.0, _p(ttft, 99)
