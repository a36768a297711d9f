"""The OpenAI-compatible server and AsyncLLM: the official client, greedy equality with
LLM.generate, 32 concurrent streams, aborts that free KV blocks, 400s for bad requests,
Prometheus metrics.

One engine for the whole module: the reference outputs come from ``LLM.generate`` on it
first, then the same engine is served (``AsyncLLM.from_llm``), so the weights load once.
"""
import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from minillm import LLM, SamplingParams
from tests.prompts import SHORT

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(engine="paged", device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of the offline facade, computed before the server drives the engine."""
    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate(SHORT, greedy)
    chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20))[0]
    return {"completions": {p: (o.text, len(o.token_ids), str(o.finish_reason)) for p, o in zip(SHORT, outs)},
            "chat": (chat.text, len(chat.token_ids), str(chat.finish_reason))}


@pytest.fixture(scope="module")
def server(llm, reference):
    from minillm.serving.async_llm import AsyncLLM
    from minillm.serving.server import serve_in_background

    handle = serve_in_background(async_llm=AsyncLLM.from_llm(llm))
    yield handle
    handle.stop()
    handle.llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_engine_idle(llm, timeout=20.0):
    """Until no request is queued, running or holding a KV block (the engine thread works meanwhile)."""
    sched = llm.engine.scheduler
    bm = sched.block_manager
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sched.running and not sched.waiting and bm.num_free_blocks == bm.num_blocks and not llm.num_in_flight:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle after {timeout}s: running={len(sched.running)} "
                         f"waiting={len(sched.waiting)} free={bm.num_free_blocks}/{bm.num_blocks}")


@pytest.fixture
def abort_spy(server, monkeypatch):
    """Records every request the engine aborts: (request_id, output tokens at abort, blocks after)."""
    engine = server.llm.engine
    seen = []
    original = engine.abort

    def spy(request):
        original(request)
        seen.append((request.request_id, request.num_output_tokens, list(request.block_ids)))

    monkeypatch.setattr(engine, "abort", spy)
    return seen


slow = pytest.mark.slow  # every test that needs the real model; the command-line checks do not


# -- the official client ------------------------------------------------------------------

@slow
def test_completions_non_streaming_and_streaming_agree_with_llm_generate(client, reference):
    prompt = SHORT[0]
    text, n, finish = reference["completions"][prompt]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens > 0
    assert r.object == "text_completion" and r.model == MODEL
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finish]
    assert chunks[-1].usage.completion_tokens == n
    # Text arrives as it is generated: several chunks, not one at the end.
    assert len([c for c in chunks if c.choices]) >= 3


@slow
def test_chat_non_streaming_and_streaming_agree_with_llm_chat(client, reference):
    text, n, finish = reference["chat"]
    assert "Paris" in text
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == finish and r.usage.completion_tokens == n
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish


@slow
def test_greedy_outputs_through_the_server_equal_llm_generate(server, reference):
    """All prompts at once: batched together in the server, alone or together offline."""
    import openai

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*[aclient.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
                                    for p in SHORT])
        await aclient.close()
        return rs

    for p, r in zip(SHORT, asyncio.run(main())):
        text, n, finish = reference["completions"][p]
        assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, finish), p


@slow
def test_seeded_sampling_through_the_server_is_reproducible(client):
    kw = dict(model=MODEL, prompt=SHORT[2], max_tokens=8, temperature=0.9, top_p=0.95, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@slow
def test_32_concurrent_streaming_clients_complete_with_exact_token_counts(server):
    import openai

    lengths = [3 + i % 4 for i in range(32)]

    async def one(aclient, i):
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"{SHORT[i % len(SHORT)]} ({i})", max_tokens=lengths[i], temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*[one(aclient, i) for i in range(32)])
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 32
    for i, chunks in enumerate(results):
        usage = chunks[-1].usage
        assert usage.completion_tokens == lengths[i], i
        token_chunks = [c for c in chunks if c.choices]
        # One chunk per step that gave this request a token (merged if the client fell behind).
        assert 1 <= len(token_chunks) <= lengths[i]
        assert token_chunks[-1].choices[0].finish_reason == "length"
    wait_engine_idle(server.llm)


# -- aborts ---------------------------------------------------------------------------------

@slow
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, abort_spy):
    body = {"model": MODEL, "prompt": SHORT[2], "max_tokens": 300, "ignore_eos": True, "stream": True}
    rid = None
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    rid = json.loads(line[6:])["id"]
                    seen += 1
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream
    wait_engine_idle(server.llm)
    aborted = {r: (n, blocks) for r, n, blocks in abort_spy}
    assert rid in aborted, f"request {rid} was not aborted: {abort_spy}"
    n, blocks = aborted[rid]
    assert 3 <= n < 300 and blocks == []  # stopped early, and holds nothing
    # The server keeps serving.
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@slow
def test_async_llm_cancel_frees_blocks(server, abort_spy):
    llm = server.llm
    bm = llm.engine.scheduler.block_manager

    async def main():
        # aclose() after a few outputs
        agen = llm.generate(SHORT[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                            request_id="closed")
        got = 0
        async for out in agen:
            got += len(out.token_ids)
            if got >= 2:
                break
        await agen.aclose()
        await llm.wait_idle()
        assert bm.num_free_blocks == bm.num_blocks
        # cancelling the consuming task
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate(SHORT[3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                        request_id="cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await llm.wait_idle()
        assert bm.num_free_blocks == bm.num_blocks
        # abort by id
        stream = await llm.add_request(SHORT[4], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                       request_id="by-id")
        first = await stream.__anext__()
        assert await llm.abort("by-id") is True
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert len(first.token_ids) + sum(len(o.token_ids) for o in outs) == outs[-1].num_output_tokens < 200

    asyncio.run(main())
    ids = {r: n for r, n, _ in abort_spy}
    assert set(ids) >= {"closed", "cancelled", "by-id"} and all(n < 200 for n in ids.values())
    wait_engine_idle(llm)


@slow
def test_async_llm_streams_text_deltas_that_add_up(server, reference):
    llm = server.llm

    async def main():
        outs = [o async for o in llm.generate(SHORT[0], SamplingParams(temperature=0, max_tokens=12))]
        return outs

    outs = asyncio.run(main())
    text, n, finish = reference["completions"][SHORT[0]]
    assert "".join(o.text for o in outs) == text == outs[-1].output.text
    assert sum(len(o.token_ids) for o in outs) == n and outs[-1].finish_reason == finish
    assert all(not o.finished for o in outs[:-1]) and outs[-1].finished


@slow
def test_async_llm_rejects_bad_input_before_any_output(server):
    llm = server.llm

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.add_request([7] * (MAX_MODEL_LEN + 5), SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="exactly one"):
            await llm.add_request(None, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="SamplingParams"):
            await llm.add_request("hi", {"max_tokens": 2})

    asyncio.run(main())
    wait_engine_idle(llm)


# -- bad requests ------------------------------------------------------------------------------

LONG_TEXT = "the history of computing " * 200  # ~800 tokens > MAX_MODEL_LEN
BAD = [
    ("completions", '{"prompt": "hi",', "invalid_json"),
    ("completions", "[1, 2, 3]", "invalid_json"),
    ("completions", "", "invalid_json"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": LONG_TEXT, "max_tokens": 4}, "max_model_len"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 2}, "n"),
    ("completions", {"prompt": 42}, "prompt"),
    ("completions", {"prompt": [1, 2, 99_999_999]}, "49152"),
    ("completions", {"prompt": ""}, "empty"),
    ("completions", {"prompt": ["one", "two"]}, "prompt"),
    ("completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("completions", {"prompt": "hi", "max_token": 5}, "max_token"),
    ("completions", {"prompt": "hi", "seed": -3}, "seed"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "logprobs": 5}, "logprobs"),
    ("completions", {"max_tokens": 5}, "prompt"),
    ("chat/completions", {"max_tokens": 5}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages"),
    ("chat/completions", {"messages": CHAT, "n": 3}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages"),
    ("completions", '{"prompt": "hi", "temperature": 1e999}', "temperature"),
    ("completions", {"prompt": "hi", "top_k": 0}, "top_k"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": [[]]}, "empty"),
    ("completions", b'{"prompt": "\xff\xfe"}', "invalid_json"),
    # text the tokenizer cannot encode, nesting, numbers past CPython's digit limit: the client's mistakes
    ("completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "invalid_text"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}', "invalid_text"),
    ("completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "invalid_json"),
    ("completions", '{"prompt": "hi", "max_tokens": ' + "7" * 5000 + "}", "invalid_json"),
]


@slow
@pytest.mark.parametrize("route, body, mention", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_request_is_a_400_with_an_openai_error_body(server, route, body, mention):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/{route}", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert mention in err["message"] or mention == err["param"] or mention == err["code"], err
    assert "Traceback" not in r.text


@slow
def test_the_server_keeps_serving_after_bad_requests(server, client):
    for route, body, _ in BAD:
        httpx.post(f"{server.url}/v1/{route}", content=body if isinstance(body, (str, bytes)) else json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=60)
    r = client.completions.create(model=MODEL, prompt=SHORT[0], max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    wait_engine_idle(server.llm)


@slow
@pytest.mark.skipif("priority" not in {f.name for f in __import__("dataclasses").fields(SamplingParams)},
                    reason="this engine has no request priorities")
def test_priority_extension_reaches_sampling_params(server, client):
    r = client.completions.create(model=MODEL, prompt=SHORT[0], max_tokens=2, temperature=0,
                                  extra_body={"priority": "interactive"})
    assert r.usage.completion_tokens == 2
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "priority": "vip"}, timeout=60)
    assert bad.status_code == 400 and "priority" in bad.json()["error"]["message"]


@slow
def test_openai_client_raises_bad_request_error(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)


@slow
def test_an_unknown_model_is_a_404_model_not_found(server, client):
    """OpenAI's and vLLM's answer (it was a 400)."""
    import openai

    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "model": "gpt-4"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model" and "gpt-4" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


@slow
def test_unknown_route_is_a_json_404(server):
    r = httpx.get(server.url + "/v1/engines", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# -- models, health, metrics ---------------------------------------------------------------------

@slow
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def _scrape(server):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return samples


@slow
def test_metrics_parse_as_prometheus_text_and_count_tokens(server, client):
    before = _scrape(server)
    r = client.completions.create(model=MODEL, prompt=SHORT[1], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    after = _scrape(server)
    gen = ("minillm_generation_tokens_total", ())
    assert after[gen] - before.get(gen, 0) == 5
    prompt = ("minillm_prompt_tokens_total", ())
    assert after[prompt] - before.get(prompt, 0) == r.usage.prompt_tokens
    ttft_count = ("minillm_time_to_first_token_seconds_count", ())
    assert after[ttft_count] - before.get(ttft_count, 0) == 1
    itl_count = ("minillm_inter_token_latency_seconds_count", ())
    assert after[itl_count] - before.get(itl_count, 0) == 4
    assert after[("minillm_request_success_total", (("finished_reason", "length"),))] >= 1
    for name in ("minillm_num_requests_running", "minillm_num_requests_waiting", "minillm_kv_cache_blocks_used",
                 "minillm_kv_cache_blocks_total", "minillm_num_preemptions_total"):
        assert (name, ()) in after, name
    assert after[("minillm_kv_cache_blocks_total", ())] == server.llm.engine.scheduler.block_manager.num_blocks
    assert after[("minillm_request_errors_total", (("status", "400"),))] >= 1


@slow
def test_metrics_names_are_the_declared_ones_and_engine_state_is_the_snapshot(server, client):
    """Every family /metrics exports is named in minillm/serving/prometheus.py (where the
    dashboard reads the names too), and the engine's numbers are those of its snapshot."""
    from prometheus_client.parser import text_string_to_metric_families

    from minillm.metrics import EngineSnapshot
    from minillm.serving import prometheus

    client.completions.create(model=MODEL, prompt=SHORT[0], max_tokens=3, temperature=0)
    wait_engine_idle(server.llm)
    declared = {v for k, v in vars(prometheus).items() if k.isupper() and isinstance(v, str) and v.startswith("minillm_")}
    page = httpx.get(server.url + "/metrics", timeout=10).text
    # prometheus_client adds each counter's and histogram's creation time, read back as a family of its own
    exported = {f.name.removesuffix("_created") for f in text_string_to_metric_families(page)}
    assert exported and exported <= declared, exported - declared
    deadline = time.monotonic() + 10  # the engine thread takes its snapshot just after it publishes the outputs
    while server.llm.stats.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = server.llm.stats
    assert isinstance(snap, EngineSnapshot)
    bm = server.llm.engine.scheduler.block_manager
    assert (snap.kv_blocks_total, snap.kv_blocks_used, snap.num_running, snap.num_waiting) == (bm.num_blocks, 0, 0, 0)
    after = _scrape(server)
    assert after[("minillm_kv_cache_blocks_total", ())] == snap.kv_blocks_total
    assert after[("minillm_num_preemptions_total", ())] == snap.num_preemptions


@slow
def test_metrics_show_requests_in_flight(server):
    """While a long request runs, /metrics shows it running and holding blocks."""
    done = threading.Event()

    def run():
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": SHORT[0], "max_tokens": 20,
                                                         "ignore_eos": True}, timeout=120)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    seen = None
    deadline = time.monotonic() + 30
    while not done.is_set() and time.monotonic() < deadline:
        s = _scrape(server)
        if s[("minillm_num_requests_running", ())] >= 1:
            seen = s
            break
        time.sleep(0.02)
    t.join()
    assert seen is not None and seen[("minillm_kv_cache_blocks_used", ())] >= 1


@slow
def test_an_engine_failure_is_an_error_body_not_a_traceback(llm):
    """A step that raises (a bug): streams end with an error event, later requests get a JSON
    503, /health turns 503. A tiny model with SmolLM2's tokenizer (loaded already) keeps it cheap."""
    from minillm import EngineConfig, ModelConfig
    from minillm.engine import build_engine
    from minillm.serving.async_llm import AsyncLLM
    from minillm.serving.server import serve_in_background

    tiny = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
    engine = build_engine(EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=128),
                          model_config=tiny)

    def broken_step():
        raise RuntimeError("a bug in a step")

    engine.step = broken_step
    served = AsyncLLM(engine)
    try:
        with serve_in_background(async_llm=served) as h:
            body = {"prompt": "Hello", "max_tokens": 4, "stream": True}
            with httpx.stream("POST", h.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert json.loads(events[0])["error"]["type"] == "internal_error" and events[-1] == "[DONE]"
            r = httpx.post(h.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
            assert r.status_code == 503 and r.json()["error"]["type"] == "internal_error"
            assert "Traceback" not in r.text and "a bug in a step" not in r.text
            assert httpx.get(h.url + "/health", timeout=10).status_code == 503
    finally:
        served.shutdown()
    assert not engine.scheduler.running and not engine.scheduler.waiting  # the failed request was aborted


def test_async_llm_from_config_rejects_unknown_options():
    from minillm.serving.async_llm import AsyncLLM

    with pytest.raises(ValueError, match="valid options"):
        AsyncLLM.from_config(max_batch=4)
    with pytest.raises(ValueError, match="LLMEngine"):
        AsyncLLM(object())


# -- the command line (no model load) -------------------------------------------------------------

@pytest.mark.parametrize("args, mention", [
    (["--engine-option", "no_such_option=1"], "no_such_option"),
    (["--engine", "warp"], "warp"),
    (["--num-speculative-tokens", "3"], "--speculative-method"),
    (["--engine-option", "novalue"], "KEY=VALUE"),
])
def test_serve_rejects_bad_options_before_loading_the_model(args, mention, capsys):
    from minillm.__main__ import main

    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and mention in err[0], err


def test_serve_bad_option_is_one_line_without_traceback():
    r = subprocess.run([sys.executable, "-m", "minillm", "serve", "--engine", "warp"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "warp" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert "serve" in subprocess.run([sys.executable, "-m", "minillm", "--help"], capture_output=True, text=True,
                                     timeout=120).stdout
