"""Runs one bench workload through llama.cpp, in the Python that has llama-cpp-python (``make peer-llamacpp``).

    python minillm/bench/llamacpp_peer.py JOB.json RESULT.json

``python -m minillm bench --engine ...,llamacpp`` writes JOB.json and starts this file as a
script in another interpreter, so this file imports nothing of minillm (only the standard
library, ``llama_cpp`` and its dependency numpy) and speaks JSON.

JOB.json::

    {"model": "<the model's GGUF file>", "n_ctx": 256, "n_batch": 256, "n_threads": 2,
     "parallel": 1, "kv_unified": true, "heartbeat_s": null,
     "requests": [{"prompt_token_ids": [...], "max_tokens": 20, "arrival_time": 0.0}, ...]}

Every request: its prompt goes in as token ids (no BOS added, no template), and exactly
``max_tokens`` tokens are decoded greedily with EOS ignored. Arrivals are replayed in real
time (``arrival_time`` seconds after the start). Each token is stamped when it is sampled:
the same definition of TTFT / TPOT / ITL as minillm's engines.

``parallel`` 1 (the default), batch 1: one request at a time, in order of arrival; a request
that arrives while another runs waits for it (the wait is part of its TTFT). For each
request the KV cache is cleared, then ``Llama.eval`` and ``Llama.sample(temp=0)``, token by
token (``run``).

``parallel`` P > 1, parallel slots, as llama.cpp's server serves ``-np P`` (``serve``): one
llama context with ``n_seq_max`` = P and one KV cache of P x ``n_ctx`` cells (unified across
the sequences unless ``kv_unified`` is false), each slot a sequence id. Each step is ONE
``llama_decode`` of a ``llama_batch`` holding the last sampled token of every decoding
sequence, then prompt tokens of admitted sequences (first come, first served, a prompt
split across steps when it does not fit in ``n_batch``), each token with its sequence's
id and position; logits are asked for each sequence's last token in the batch when that
token completes its prompt or is a decode token, and the next token is their argmax.
A finished sequence's cells are removed (``llama_memory_seq_rm``) and its slot takes the
next arrived request, in order of arrival.

Logits instead of a run: a job with ``"logits_of": [[token ids], ...]`` (and no ``requests``)
feeds each sequence from an empty KV cache (no BOS added) and writes the logits llama.cpp
computed at every position, float32 [len, vocab], to ``logits_<i>.npy`` next to RESULT.json,
whose ``logits_files`` lists them (``logits``).

RESULT.json: ``start`` and ``end`` (perf_counter seconds of this process), per request
``token_ids``, ``token_times``, ``arrival_time``, ``finish_time`` (parallel slots add
``scheduled_time`` and ``slot``); and what llama.cpp ran with (version, n_ctx, n_batch,
threads, parallel, forward passes; parallel slots add ``steps``, one per ``llama_decode``:
start, end, the requests in the batch and the tokens each fed, the sequences holding a
slot after the step, the arrived requests still waiting for one).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import deque


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


def serve(slots, requests: list[dict], n_slots: int, n_batch: int, now=time.perf_counter, sleep=time.sleep,
          heartbeat_s: float | None = None) -> tuple[float, float, list[dict], list[dict]]:
    """Replay ``requests`` through ``n_slots`` parallel sequences, continuous batching as llama.cpp's server does.

    ``slots`` runs the batches: ``slots.step(entries)`` decodes ONE batch, ``entries`` a list of
    ``(seq_id, tokens, first_position, wants_token)``, and returns, for each entry that wants
    a token, the argmax after its last token, in the entries' order; ``slots.remove(seq_id)``
    drops a sequence's KV cells. (``LlamaSlots`` does that with llama.cpp; tests pass a stand-in.)

    Each step: requests that have arrived take free slots in order of arrival (the lowest
    free sequence id first); the batch gets one token per decoding sequence, then prompt
    tokens of sequences still prefilling, in order of admission, up to ``n_batch`` tokens
    (a prompt that does not fit continues next step). The tokens a step samples are all
    stamped with the step's end. A sequence that has its ``max_tokens`` leaves, its slot free
    for the next step. With nothing running, the loop sleeps until the next arrival.

    Returns start, end, per request its tokens and times (plus ``scheduled_time``, ``slot``),
    and per step its start, end, ``requests`` (indices) and ``tokens`` (fed by each), ``sampled``
    (tokens it sampled), ``running`` (sequences holding a slot after it) and ``waiting``
    (arrived, no slot)."""
    if n_slots < 1 or n_batch < n_slots:
        raise ValueError(f"need 1 <= n_slots <= n_batch, got n_slots={n_slots}, n_batch={n_batch}")
    recs: list[dict] = [{"token_ids": [], "token_times": [], "finish_time": None, "scheduled_time": None,
                         "slot": None} for _ in requests]
    pending = deque(sorted(range(len(requests)), key=lambda i: (requests[i].get("arrival_time", 0.0), i)))
    start = now()
    for i, r in enumerate(requests):
        recs[i]["arrival_time"] = start + r.get("arrival_time", 0.0)
    free = list(range(n_slots))  # sequence ids not in use
    running: list[dict] = []  # in order of admission: {i, seq, feed (prompt tokens not fed yet), pos, last}
    steps: list[dict] = []
    total, done, last_beat = sum(r["max_tokens"] for r in requests), 0, start
    while pending or running:
        t0 = now()
        while pending and free and recs[pending[0]]["arrival_time"] <= t0:
            i = pending.popleft()
            recs[i].update(scheduled_time=t0)
            if requests[i]["max_tokens"] <= 0:  # nothing to decode: done on admission
                recs[i]["finish_time"] = t0
                continue
            seq = min(free)
            free.remove(seq)
            recs[i]["slot"] = seq
            running.append(dict(i=i, seq=seq, feed=list(requests[i]["prompt_token_ids"]), pos=0, last=None))
        if not running:
            if pending:
                wait = recs[pending[0]]["arrival_time"] - now()
                if wait > 0:
                    sleep(wait)
            continue
        entries, rows, budget = [], [], n_batch
        for s in running:  # decode tokens first: one per sequence past its prompt
            if not s["feed"]:
                entries.append((s["seq"], [s["last"]], s["pos"], True))
                rows.append(s)
                budget -= 1
        for s in running:  # then prompt tokens, in order of admission
            if s["feed"] and budget > 0:
                chunk = s["feed"][:budget]
                entries.append((s["seq"], chunk, s["pos"], len(chunk) == len(s["feed"])))
                rows.append(s)
                budget -= len(chunk)
        sampled = iter(slots.step(entries))
        t = now()
        for (seq, toks, pos, wants), s in zip(entries, rows):
            s["pos"] = pos + len(toks)
            if s["feed"]:
                s["feed"] = s["feed"][len(toks):]
            if wants:
                s["last"] = tok = int(next(sampled))
                rec = recs[s["i"]]
                rec["token_ids"].append(tok)
                rec["token_times"].append(t)
                done += 1
        for s in [s for s in running if len(recs[s["i"]]["token_ids"]) >= requests[s["i"]]["max_tokens"]]:
            recs[s["i"]]["finish_time"] = t
            slots.remove(s["seq"])
            free.append(s["seq"])
            running.remove(s)
        steps.append(dict(start=t0, end=t, requests=[s["i"] for s in rows], tokens=[len(e[1]) for e in entries],
                          sampled=sum(1 for e in entries if e[3]), running=len(running),
                          waiting=sum(1 for i in pending if recs[i]["arrival_time"] <= t)))
        if heartbeat_s and t - last_beat >= heartbeat_s:
            print(f"llamacpp: {done}/{total} tokens, {t - start:.0f} s", file=sys.stderr, flush=True)
            last_beat = t
    end = max((r["finish_time"] for r in recs), default=start)
    return start, end, recs, steps


class LlamaSlots:
    """``serve``'s batches on llama.cpp: a second context on ``llm``'s model (its settings,
    but ``n_seq_max`` = ``n_slots`` and a KV cache of ``n_slots x n_ctx_per_slot`` cells),
    one ``llama_batch`` of ``n_batch`` tokens, one ``llama_decode`` per step."""

    def __init__(self, llama_cpp, llm, n_slots: int, n_ctx_per_slot: int, n_batch: int, kv_unified: bool = True):
        import numpy as np

        self._lib, self._np = llama_cpp, np
        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        params.n_ctx = n_slots * n_ctx_per_slot
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_slots
        params.kv_unified = kv_unified
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {params.n_ctx}, n_seq_max {n_slots})")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
        self.n_batch, self.n_seq_max = n_batch, llama_cpp.llama_n_seq_max(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def n_ctx(self) -> int:
        return self._lib.llama_n_ctx(self.ctx)

    def step(self, entries) -> list[int]:
        b, n, outs = self.batch, 0, []
        for seq, toks, pos, wants in entries:
            for k, tok in enumerate(toks):
                b.token[n], b.pos[n], b.n_seq_id[n] = tok, pos + k, 1
                b.seq_id[n][0] = seq
                b.logits[n] = wants and k == len(toks) - 1
                n += 1
            if wants:
                outs.append(n - 1)
        if n > self.n_batch:
            raise ValueError(f"a batch of {n} tokens, more than n_batch {self.n_batch}")
        b.n_tokens = n
        rc = self._lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} on a batch of {n} tokens")
        as_array = self._np.ctypeslib.as_array
        return [int(as_array(self._lib.llama_get_logits_ith(self.ctx, j), shape=(self.n_vocab,)).argmax())
                for j in outs]

    def remove(self, seq_id: int) -> None:
        self._lib.llama_memory_seq_rm(self.mem, seq_id, -1, -1)

    def close(self) -> None:
        if self.batch is not None:
            self._lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self._lib.llama_free(self.ctx)
            self.ctx = None


def logits(llm, sequences: list[list[int]], out_dir: str) -> list[str]:
    """The logits at every position of each sequence (``llm`` built with ``logits_all=True``),
    each sequence fed whole from an empty KV cache, saved as ``out_dir/logits_<i>.npy``."""
    import numpy as np

    files = []
    for i, seq in enumerate(sequences):
        llm.reset()
        llm.eval(list(seq))
        name = f"logits_{i}.npy"
        np.save(os.path.join(out_dir, name), np.asarray(llm.scores[: len(seq)], dtype=np.float32))
        files.append(name)
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python llamacpp_peer.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        job = json.load(f)
    import llama_cpp

    threads = job["n_threads"]
    n_batch = job.get("n_batch") or job["n_ctx"]
    parallel = int(job.get("parallel") or 1)
    wants_logits = "logits_of" in job
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_batch=n_batch, n_ubatch=n_batch,
                          n_threads=threads, n_threads_batch=threads, logits_all=wants_logits, verbose=False)
    result = {"llama_cpp_version": llama_cpp.__version__, "n_threads": threads, "parallel": parallel}
    if wants_logits:
        result["logits_files"] = logits(llm, job["logits_of"], os.path.dirname(os.path.abspath(argv[2])))
        with open(argv[2], "w") as f:
            json.dump(result, f)
        return 0
    if parallel == 1:
        # Warm up (first-call allocations), outside the measurement, as minillm does.
        generate(llm, [1, 2, 3, 4], 2)
        start, end, recs, passes = run(llm, job["requests"], heartbeat_s=job.get("heartbeat_s"))
        result.update(n_ctx=llm.n_ctx(), n_batch=llm.n_batch, forward_passes=passes)
    else:
        n_batch = max(n_batch, parallel)
        kv_unified = bool(job.get("kv_unified", True))
        slots = LlamaSlots(llama_cpp, llm, parallel, job["n_ctx"], n_batch, kv_unified)
        try:
            # Warm up: a prompt and a decode step in every slot, then an empty cache.
            serve(slots, [{"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 2}] * parallel, parallel, n_batch)
            start, end, recs, steps = serve(slots, job["requests"], parallel, n_batch,
                                            heartbeat_s=job.get("heartbeat_s"))
            result.update(n_ctx=slots.n_ctx(), n_ctx_per_slot=job["n_ctx"], n_batch=n_batch,
                          n_seq_max=slots.n_seq_max, kv_unified=kv_unified, forward_passes=len(steps), steps=steps)
        finally:
            slots.close()
    result.update(start=start, end=end, requests=recs)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
