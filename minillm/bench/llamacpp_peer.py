"""Runs one bench workload through llama.cpp, in the Python that has llama-cpp-python (``make peer-llamacpp``).

    python minillm/bench/llamacpp_peer.py JOB.json RESULT.json

``python -m minillm bench --engine ...,llamacpp`` writes JOB.json and starts this file as a
script in another interpreter, so this file imports nothing of minillm (only the standard
library and ``llama_cpp``) and speaks JSON.

JOB.json::

    {"model": "<the model's GGUF file>", "n_ctx": 256, "n_batch": 256, "n_threads": 2,
     "heartbeat_s": null,
     "requests": [{"prompt_token_ids": [...], "max_tokens": 20, "arrival_time": 0.0}, ...]}

Batch 1: one request at a time, in order of arrival; a request that arrives while another
runs waits for it (the wait is part of its TTFT). Arrivals are replayed in real time
(``arrival_time`` seconds after the start). For each request the KV cache is cleared, the
prompt goes in as token ids (no BOS added, no template), and exactly ``max_tokens`` tokens
are decoded greedily with EOS ignored: ``Llama.eval`` then ``Llama.sample(temp=0)``, token
by token. Each token is stamped when it is sampled: the same definition of TTFT / TPOT /
ITL as minillm's engines.

RESULT.json: ``start`` and ``end`` (perf_counter seconds of this process), per request
``token_ids``, ``token_times``, ``arrival_time``, ``finish_time``; and what llama.cpp ran
with (version, n_ctx, n_batch, threads, forward passes).
"""
from __future__ import annotations

import json
import sys
import time


def generate(llm, prompt_token_ids: list[int], max_tokens: int, now=time.perf_counter) -> tuple[list[int], list[float], int]:
    """Greedy decoding of exactly ``max_tokens`` tokens after ``prompt_token_ids``, from an empty KV cache.

    Returns the tokens, the time each was sampled, and the forward passes run (the prompt
    takes one per ``n_batch`` tokens, every further token one)."""
    llm.reset()  # n_tokens = 0: the next eval drops every cached position first
    tokens: list[int] = []
    times: list[float] = []
    passes = 0
    feed = list(prompt_token_ids)
    while len(tokens) < max_tokens:
        llm.eval(feed)
        passes += -(-len(feed) // llm.n_batch)
        tok = int(llm.sample(top_k=1, temp=0.0, repeat_penalty=1.0))
        tokens.append(tok)
        times.append(now())
        feed = [tok]
    return tokens, times, passes


def run(llm, requests: list[dict], now=time.perf_counter, sleep=time.sleep,
        heartbeat_s: float | None = None) -> tuple[float, float, list[dict], int]:
    """Replay ``requests`` through ``llm`` (a ``llama_cpp.Llama``), one at a time in order of arrival.

    Returns start, end, per request its tokens and times, and the forward passes of the run.
    ``heartbeat_s``: print the tokens done so far to stderr at most that often (between requests)."""
    recs: list[dict] = [{"token_ids": [], "token_times": [], "finish_time": None} for _ in requests]
    order = sorted(range(len(requests)), key=lambda i: requests[i].get("arrival_time", 0.0))
    start = now()
    for i, r in enumerate(requests):
        recs[i]["arrival_time"] = start + r.get("arrival_time", 0.0)
    total, done, passes, last_beat = sum(r["max_tokens"] for r in requests), 0, 0, start
    for i in order:
        wait = recs[i]["arrival_time"] - now()
        if wait > 0:
            sleep(wait)
        toks, times, n = generate(llm, requests[i]["prompt_token_ids"], requests[i]["max_tokens"], now)
        recs[i].update(token_ids=toks, token_times=times, finish_time=times[-1] if times else now())
        done, passes = done + len(toks), passes + n
        t = now()
        if heartbeat_s and t - last_beat >= heartbeat_s:
            print(f"llamacpp: {done}/{total} tokens, {t - start:.0f} s", file=sys.stderr, flush=True)
            last_beat = t
    end = max((r["finish_time"] for r in recs), default=start)
    return start, end, recs, passes


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python llamacpp_peer.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        job = json.load(f)
    import llama_cpp

    threads = job["n_threads"]
    n_batch = job.get("n_batch") or job["n_ctx"]
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_batch=n_batch, n_ubatch=n_batch,
                          n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    # Warm up (first-call allocations), outside the measurement, as minillm does.
    generate(llm, [1, 2, 3, 4], 2)
    start, end, recs, passes = run(llm, job["requests"], heartbeat_s=job.get("heartbeat_s"))
    result = {"llama_cpp_version": llama_cpp.__version__, "start": start, "end": end, "requests": recs,
              "n_ctx": llm.n_ctx(), "n_batch": llm.n_batch, "n_threads": threads, "forward_passes": passes}
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
