"""An open-loop load generator that speaks only the OpenAI API.

    python -m minillm load --url http://127.0.0.1:8000 --rate 2 --num-requests 40
    python -m minillm load --url http://127.0.0.1:8000 --sweep 0.5,1,2,4 --json sweep.json
    python -m minillm load --url http://127.0.0.1:8000 --trace trace.jsonl
    python -m minillm load --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 --trace trace.jsonl   # A/B

Open loop: request i is sent at its arrival time whether or not the earlier ones have
finished, as independent users would send them. (A closed loop, N clients that each wait
for their answer, slows its own arrivals down when the server saturates, and so hides the
queueing it should measure.) Poisson arrivals at ``rate`` requests/s have exponential
gaps with mean 1/rate.

Every request streams (``stream: true``) and asks for exactly ``max_tokens`` tokens
(``ignore_eos: true``, an extension vLLM's and minillm's servers accept;
``--no-ignore-eos`` leaves it out for servers that do not), so every run does the same
work. Measured on the client, per request:

    TTFT   send -> first streamed token chunk        (queueing + prefill + transport)
    ITL    gaps between consecutive token chunks     (one chunk may carry several tokens
                                                      with speculative decoding)
    TPOT   (last chunk - first chunk) / (output tokens - 1)
    E2E    send -> end of the stream

A server that pushes back (HTTP 429, its queue full; minillm's ``serve
--max-queued-requests``) fails the request: ``num_rejected`` in the summary counts those,
and no request is retried (an open loop does not slow down).

Goodput: requests per second that finished *and* met the SLO (TTFT <= slo_ttft and
TPOT <= slo_tpot), the number a service is paid for (DistServe, Zhong et al. 2024).
Throughput counts every finished request, however late.

The arrivals and the goodput are seams (``minillm/seams.py``, chapter 7's exercises): a
plugged ``poisson_arrivals(rate, n, seed)`` makes the arrival times of every open-loop run
(this generator's and ``minillm.bench.sweep.run_open_loop``'s), a plugged
``goodput(ttfts, tpots, duration, slo_ttft, slo_tpot)`` counts every run's goodput. What a
plugged function returns is checked here: a wrong shape is a ``seams.SeamContractError``
naming the seam.

It imports nothing from the engine: the same command measures any OpenAI-compatible
server. Trace files are JSON lines, one request each:

    {"arrival": 0.0, "prompt": "Explain how a rainbow forms.", "output_tokens": 64}
    {"arrival": 0.4, "prompt_tokens": 300, "output_tokens": 20}
    {"arrival": 0.9, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}

(``arrival`` in seconds from the start; ``prompt`` text or token ids, ``prompt_tokens``: a
prompt of that many token ids, which the OpenAI API accepts as a list, or ``messages``: a
chat, sent to /v1/chat/completions; ``output_tokens``, or ``max_tokens``.) ``python -m
minillm serve --record-trace T.jsonl`` writes the traffic a server receives in this format.

A/B: with two ``--url`` the same requests at the same arrival times are replayed against
server A, then against server B: one after the other, never at once, because two servers
sharing one machine's cores would measure their contention rather than themselves.
``--rounds N`` replays N times per side in alternating order (A B, B A, A B, ...), so a
drift of the machine's speed during the run (other jobs, heat) weighs on both sides alike,
and the bootstrap then draws the replays as well as their requests: replays of one server
that disagree widen the interval rather than pass for a difference between the servers.
With one round (the default) the interval sees only the requests' own noise; on a shared
machine use three or more. Each server first answers one short warm-up request that is
not measured. ``minillm.bench.ab`` gives every metric B - A with a bootstrap confidence
interval and a verdict: better, worse, or no difference.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from minillm import seams
from minillm.bench.prompts import INSTRUCTIONS

DEFAULT_PROMPTS = INSTRUCTIONS[:12]  # short instructions: the first twelve of bench/prompts.py's


@dataclass(slots=True)
class LoadRequest:
    """One request of a run: a prompt (text, token ids, or chat messages: a list of {"role", "content"},
    sent to /v1/chat/completions), exact output length, arrival offset (s)."""

    prompt: str | list[int] | list[dict]
    output_tokens: int
    arrival: float = 0.0


# -- arrivals and requests ---------------------------------------------------------------------

def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds from 0, the first at 0) of a Poisson process at ``rate`` per second.

    A plugged ``poisson_arrivals`` (chapter 7) makes them instead, once the arguments are
    checked here; its list is checked too (``n`` finite numbers, the first 0, never going back).
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a finite number > 0 requests per second, got {rate!r}")
    _check_count("n", n)
    mine = seams.plugged("poisson_arrivals")  # a learner's version (chapter 7), when plugged in
    if mine is not None:
        return _checked_arrivals(mine(rate, n, seed), n)
    rng = random.Random(seed)  # the exercise's hint draws the same gaps: a learner's run is comparable step by step
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _checked_arrivals(times: Any, n: int) -> list[float]:
    """What a plugged ``poisson_arrivals`` returned, as a list of floats; ``seams.SeamContractError`` if it
    cannot be arrivals: ``n`` finite numbers >= 0, the first 0, never going back."""

    def broken(invariant: str, got: str) -> seams.SeamContractError:
        return seams.SeamContractError("poisson_arrivals", invariant, got)

    if isinstance(times, (str, bytes, dict)) or not isinstance(times, Sequence):
        raise broken(f"it must return a list of {n} arrival times in seconds", f"returned a {type(times).__name__}")
    times = list(times)
    if len(times) != n:
        raise broken(f"one arrival time per request, n={n}", f"returned {len(times)} arrival times for n={n}")
    for i, t in enumerate(times):
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise broken("every arrival is a finite number of seconds >= 0", f"arrival [{i}] is {t!r}")
    if times[0] != 0:
        raise broken("the first request arrives at 0.0", f"the first arrival is {times[0]!r}")
    for i in range(1, n):
        if times[i] < times[i - 1]:
            raise broken("arrivals never go back (each gap is added to the previous time)",
                         f"arrival [{i}] ({times[i]!r}) comes before arrival [{i - 1}] ({times[i - 1]!r})")
    return [float(t) for t in times]


def make_requests(num_requests: int, output_tokens: int | Sequence[int] | None = None,
                  prompts: Sequence[str] | str | None = None, seed: int = 0) -> list[LoadRequest]:
    """``num_requests`` requests (arrival 0; set arrivals separately).

    ``prompts``: None (short instructions), a list of prompts (cycled), or the name of a
    workload of ``minillm/bench/workload.py`` (``uniform``, ``chat``, ``skewed``...): its
    prompt and output lengths, decoded to text with SmolLM2's tokenizer (this one case
    needs minillm's model package). ``output_tokens``: one length for all, or one per
    request; None: the workload's lengths, or 32.
    """
    _check_count("num_requests", num_requests)
    if isinstance(prompts, str):
        return _workload_requests(prompts, num_requests, seed, output_tokens)
    pool = list(DEFAULT_PROMPTS if prompts is None else prompts)
    if not pool or any(not (isinstance(p, str) and p) and not _is_ids(p) for p in pool):
        raise ValueError("prompts must be a non-empty list of non-empty strings (or token-id lists)")
    rng = random.Random(f"prompts:{seed}")
    order = [pool[i % len(pool)] for i in range(num_requests)]
    rng.shuffle(order)
    return [LoadRequest(p, o) for p, o in zip(order, _lengths(32 if output_tokens is None else output_tokens,
                                                               num_requests))]


def _workload_requests(name: str, n: int, seed: int, output_tokens: Any) -> list[LoadRequest]:
    from minillm.bench.workload import make_workload
    from minillm.loader import load_tokenizer

    tok = load_tokenizer(None)
    wl = make_workload(name, n, seed=seed, tokenizer=tok)
    outs = [r.max_tokens for r in wl.requests] if output_tokens is None else _lengths(output_tokens, n)
    return [LoadRequest(tok.decode(r.prompt_token_ids, skip_special_tokens=False), o)
            for r, o in zip(wl.requests, outs)]


def load_trace(path: str | Path, seed: int = 0) -> list[LoadRequest]:
    """Read a JSON-lines trace (see the module docstring); requests sorted by arrival."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    rng = random.Random(f"trace:{seed}")
    reqs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        arrival = d.get("arrival", d.get("timestamp"))
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or arrival < 0:
            raise ValueError(f"{where}: 'arrival' must be a number of seconds >= 0, got {arrival!r}")
        out = d.get("output_tokens", d.get("max_tokens"))
        if isinstance(out, bool) or not isinstance(out, int) or out < 1:
            raise ValueError(f"{where}: 'output_tokens' must be an integer >= 1, got {out!r}")
        if "prompt" in d:
            prompt = d["prompt"]
            if not (isinstance(prompt, str) and prompt) and not _is_ids(prompt):
                raise ValueError(f"{where}: 'prompt' must be non-empty text or a list of token ids")
        elif "messages" in d:
            prompt = d["messages"]
            if not _is_messages(prompt):
                raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": text, \"content\": "
                                 "text}} objects")
        elif "prompt_tokens" in d:
            n = d["prompt_tokens"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{where}: 'prompt_tokens' must be an integer >= 1, got {n!r}")
            # Ids common to most vocabularies (>= 32k entries) and past the special tokens.
            prompt = [rng.randrange(1000, 30000) for _ in range(n)]
        else:
            raise ValueError(f"{where}: give 'prompt' (text or token ids), 'messages' (a chat) or 'prompt_tokens' "
                             "(a count)")
        reqs.append(LoadRequest(prompt, out, float(arrival)))
    if not reqs:
        raise ValueError(f"trace file {str(path)!r} has no requests")
    return sorted(reqs, key=lambda r: r.arrival)


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in p)


def _is_messages(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in p)


def _lengths(output_tokens: Any, n: int) -> list[int]:
    if isinstance(output_tokens, int) and not isinstance(output_tokens, bool):
        outs = [output_tokens] * n
    else:
        outs = list(output_tokens)
        if len(outs) != n:
            raise ValueError(f"got {len(outs)} output lengths for {n} requests")
    if any(isinstance(o, bool) or not isinstance(o, int) or o < 1 for o in outs):
        raise ValueError(f"output_tokens must be integers >= 1, got {output_tokens!r}")
    return outs


def _check_count(name: str, n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n!r}")


# -- statistics ---------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics (numpy's default); None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def meets_slo(record: dict, slo_ttft: float, slo_tpot: float) -> bool:
    """Finished, first token within slo_ttft, and (with more than one token) tokens every slo_tpot on average."""
    if not record["ok"] or record["ttft"] is None or record["ttft"] > slo_ttft:
        return False
    return record["tpot"] is None or record["tpot"] <= slo_tpot


def goodput(records: Sequence[dict], slo_ttft: float = 1.0, slo_tpot: float = 0.2,
            duration: float | None = None) -> float:
    """Requests per second that met the SLO. ``duration`` defaults to the span of the run:
    from the first arrival to the last request's end.

    A plugged ``goodput`` (chapter 7) counts instead, on two lists made from the records: each
    request's TTFT (None when it failed) and TPOT (None with a single token). It is asked only
    when the duration and both SLOs are > 0 (otherwise the goodput is 0 requests/s, or no
    request can meet the SLO); what it returns is checked.
    """
    if duration is None:
        duration = _span(records)
    mine = seams.plugged("goodput")  # a learner's version (chapter 7), when plugged in
    if mine is not None and duration and duration > 0 and slo_ttft > 0 and slo_tpot > 0:
        ttfts = [r["ttft"] if r["ok"] else None for r in records]
        tpots = [r["tpot"] if r["ok"] else None for r in records]
        return _checked_goodput(mine(ttfts, tpots, duration, slo_ttft, slo_tpot), ttfts, duration)
    good = sum(meets_slo(r, slo_ttft, slo_tpot) for r in records)
    return good / duration if duration and duration > 0 else 0.0


def _checked_goodput(value: Any, ttfts: Sequence[float | None], duration: float) -> float:
    """What a plugged ``goodput`` returned, as a float; ``seams.SeamContractError`` if it cannot be the goodput
    of these requests: a whole number of them per ``duration``, at most the ones that produced a token."""

    def broken(invariant: str, got: str) -> seams.SeamContractError:
        return seams.SeamContractError("goodput", invariant, got)

    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise broken("a number of requests per second >= 0 (requests that met the SLO / duration)",
                     f"returned {value!r}")
    count = float(value) * duration
    if abs(count - round(count)) > 1e-6 * max(1.0, count):
        raise broken("(the number of requests that met the SLO) / duration",
                     f"returned {value!r} for a duration of {duration:g} s, i.e. {count:g} requests: "
                     f"not a whole number")
    finished = sum(t is not None for t in ttfts)
    if round(count) > len(ttfts):
        raise broken("each request counts at most once",
                     f"returned {value!r}: {round(count)} requests per {duration:g} s, but the run has {len(ttfts)}")
    if round(count) > finished:
        raise broken("a failed request (no TTFT) never meets the SLO",
                     f"returned {value!r}: {round(count)} requests per {duration:g} s, but only {finished} of "
                     f"{len(ttfts)} produced a token")
    return float(value)


def _span(records: Sequence[dict]) -> float:
    ends = [r["arrival"] + r["lag"] + r["e2e"] for r in records if r.get("e2e") is not None]
    starts = [r["arrival"] for r in records]
    return (max(ends) - min(starts)) if ends else 0.0


@dataclass
class LoadResult:
    """One run: per-request ``records`` and the settings; ``summary()`` turns them into numbers."""

    url: str
    rate: float | None  # offered request rate; None for a trace, inf for a burst
    records: list[dict]
    duration: float  # seconds from the first arrival to the last request's end
    slo_ttft: float = 1.0
    slo_tpot: float = 0.2
    model: str | None = None
    label: str | None = None
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.records if r["ok"]]
        d = self.duration
        out: dict[str, Any] = {
            "label": self.label, "rate": self.rate, "num_requests": len(self.records), "num_ok": len(ok),
            "num_failed": len(self.records) - len(ok), "duration_s": d,
            "num_rejected": sum(r.get("status") == 429 for r in self.records),  # pushed back: the queue was full
            "throughput_req_s": len(ok) / d if d > 0 else 0.0,
            "throughput_tok_s": sum(r["output_tokens"] for r in ok) / d if d > 0 else 0.0,
            "goodput": goodput(self.records, self.slo_ttft, self.slo_tpot, d),
            "slo_attainment": (sum(meets_slo(r, self.slo_ttft, self.slo_tpot) for r in self.records)
                               / len(self.records)) if self.records else 0.0,
            "slo_ttft": self.slo_ttft, "slo_tpot": self.slo_tpot,
            "client_lag_max": max((r["lag"] for r in self.records), default=0.0),
        }
        series = {"ttft": [r["ttft"] for r in ok if r["ttft"] is not None],
                  "tpot": [r["tpot"] for r in ok if r["tpot"] is not None],
                  "itl": [x for r in ok for x in r["itls"]],
                  "e2e": [r["e2e"] for r in ok if r["e2e"] is not None]}
        for name, xs in series.items():
            out[f"{name}_mean"] = sum(xs) / len(xs) if xs else None
            for q in (50, 95, 99):
                out[f"{name}_p{q}"] = percentile(xs, q)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.model, "summary": _finite(self.summary()),
                "records": [_finite(r) for r in self.records], "errors": self.errors}


def _finite(d: dict) -> dict:
    """JSON has no infinity: an unbounded rate is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


# -- running ------------------------------------------------------------------------------------

async def _one(client: Any, url: str, model: str, req: LoadRequest, index: int, t0: float,
               ignore_eos: bool, temperature: float) -> dict:
    chat = _is_messages(req.prompt)
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True},
                            **({"messages": req.prompt} if chat else {"prompt": req.prompt})}
    if ignore_eos:
        body["ignore_eos"] = True
    rec: dict[str, Any] = {"index": index, "arrival": req.arrival, "lag": 0.0, "ttft": None, "tpot": None,
                           "itls": [], "e2e": None, "output_tokens": 0, "prompt_tokens": None,
                           "requested_tokens": req.output_tokens, "ok": False, "error": None, "finish_reason": None,
                           "status": None}
    delay = t0 + req.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    rec["lag"] = sent - (t0 + req.arrival)  # how late the client sent it (should stay ~0)
    times: list[float] = []
    usage = None
    try:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        async with client.stream("POST", url + route, json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                rec["error"] = f"HTTP {r.status_code}: {text[:300]}"
                return rec
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chat and chunk.get("choices") and "role" in chunk["choices"][0].get("delta", {}) \
                        and not chunk["choices"][0]["delta"].get("content"):
                    continue  # a chat stream opens with the assistant's role: no token yet
                if chunk.get("choices"):
                    # One chunk per arrival of tokens (its text may be empty: a detokenizer
                    # holds back an unfinished character).
                    times.append(time.perf_counter())
                    if chunk["choices"][0].get("finish_reason"):
                        rec["finish_reason"] = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
            end = time.perf_counter()
    except Exception as e:  # noqa: BLE001 -- a failed request is a record, not a crash of the run
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    if not done or not times:
        rec["error"] = "the stream ended without [DONE]" if not done else "no tokens were streamed"
        return rec
    n = usage["completion_tokens"] if usage else len(times)
    rec.update(ok=True, ttft=times[0] - sent, e2e=end - sent, output_tokens=n,
               itls=[b - a for a, b in zip(times, times[1:])],
               tpot=(times[-1] - times[0]) / (n - 1) if n > 1 else None,
               prompt_tokens=usage["prompt_tokens"] if usage else None)
    return rec


async def run_load_async(url: str, requests: Sequence[LoadRequest], arrivals: Sequence[float] | None = None, *,
                         model: str | None = None, slo_ttft: float = 1.0, slo_tpot: float = 0.2,
                         rate: float | None = None, ignore_eos: bool = True, temperature: float = 0.0,
                         timeout: float = 600.0, label: str | None = None, api_key: str | None = None) -> LoadResult:
    """Send ``requests`` at ``arrivals`` (seconds from now; default: each request's own
    ``arrival``), stream them all, and collect one record per request. ``api_key``: sent as
    ``Authorization: Bearer <key>``."""
    import httpx

    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    requests = list(requests)
    if not requests:
        raise ValueError("no requests to send")
    if arrivals is not None:
        arrivals = list(arrivals)
        if len(arrivals) != len(requests):
            raise ValueError(f"got {len(arrivals)} arrival times for {len(requests)} requests")
        requests = [LoadRequest(r.prompt, r.output_tokens, float(a)) for r, a in zip(requests, arrivals)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits,
                                 headers=headers) as client:
        if model is None:
            model = await _first_model(client, url)
        t0 = time.perf_counter() + 0.05  # a moment to create every task before the first send
        tasks = [asyncio.create_task(_one(client, url, model, r, i, t0, ignore_eos, temperature))
                 for i, r in enumerate(requests)]
        records = await asyncio.gather(*tasks)
    errors = sorted({r["error"] for r in records if r["error"]})
    return LoadResult(url, rate, list(records), _span(records), slo_ttft, slo_tpot, model, label, errors)


async def _first_model(client: Any, url: str) -> str:
    try:
        r = await client.get(url + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"could not list the models of {url} ({type(e).__name__}: {e}); is the server up? "
                         "pass model= to skip this") from None


def run_load(url: str, *, rate: float | None = None, num_requests: int = 32,
             prompts: Sequence[str] | str | None = None, output_tokens: int | Sequence[int] | None = None,
             seed: int = 0,
             trace: str | Path | None = None, slo_ttft: float = 1.0, slo_tpot: float = 0.2,
             model: str | None = None, ignore_eos: bool = True, temperature: float = 0.0,
             timeout: float = 600.0, api_key: str | None = None) -> LoadResult:
    """One open-loop run: Poisson arrivals at ``rate`` requests/s (``float('inf')``: all at
    once), or the requests and arrivals of a ``trace`` file. Blocks until every request ends
    (from a notebook with a running event loop, ``await run_load_async(...)`` instead)."""
    requests, arrivals, label = _planned(rate, num_requests, prompts, output_tokens, seed, trace)
    return _blocking(lambda: run_load_async(url, requests, arrivals, model=model, slo_ttft=slo_ttft,
                                            slo_tpot=slo_tpot, rate=rate, ignore_eos=ignore_eos,
                                            temperature=temperature, timeout=timeout, label=label, api_key=api_key))


def _planned(rate: float | None, num_requests: int, prompts: Any, output_tokens: Any, seed: int,
             trace: str | Path | None) -> tuple[list[LoadRequest], list[float] | None, str]:
    """A run's requests, their arrival times (None: each request's own, a trace's) and its label."""
    if trace is not None:
        if rate is not None:
            raise ValueError("give a rate or a trace, not both (a trace brings its own arrival times)")
        return load_trace(trace, seed), None, f"trace {Path(trace).name}"
    if rate is None:
        raise ValueError("give rate (requests per second; float('inf') sends all at once) or trace")
    requests = make_requests(num_requests, output_tokens, prompts, seed)
    if rate == math.inf:
        arrivals = [0.0] * num_requests
    else:
        arrivals = poisson_arrivals(rate, num_requests, seed)
    return requests, arrivals, f"rate {rate:g}"


def _blocking(make_coro: Any) -> Any:
    """Run the coroutine ``make_coro()`` makes to its end; from inside a running event loop (a
    notebook cell), on a loop of its own in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


def ab_order(rounds: int) -> list[str]:
    """The order of an A/B's replays: A B, then B A, A B, ... (``rounds`` replays per side)."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1 (replays per side), got {rounds!r}")
    return [side for r in range(rounds) for side in ("AB" if r % 2 == 0 else "BA")]


def run_ab(url_a: str, url_b: str, *, rounds: int = 1, warmup: bool = True, rate: float | None = None,
           num_requests: int = 32, prompts: Sequence[str] | str | None = None,
           output_tokens: int | Sequence[int] | None = None, seed: int = 0, trace: str | Path | None = None,
           progress: Any = None, **kwargs: Any) -> tuple[list[LoadResult], list[LoadResult]]:
    """An A/B: the same requests at the same arrivals (a ``trace``, or ``rate`` with
    ``num_requests``...: made once, seeded) replayed against ``url_a`` and ``url_b``, one
    after the other in ``ab_order(rounds)``, never at once (see the module docstring).

    ``warmup``: first one short request to each server, not measured (a cold server's first
    request pays for allocations that its second does not). ``progress(side, round, result)``
    is called after each replay. ``kwargs``: ``run_load_async``'s (model, SLOs, timeout...).
    Returns (A's results, B's results), each in round order; ``minillm.bench.ab.compare``
    turns them into verdicts.
    """
    order = ab_order(rounds)
    requests, arrivals, label = _planned(rate, num_requests, prompts, output_tokens, seed, trace)
    urls = {"A": url_a, "B": url_b}
    if warmup:
        for url in urls.values():
            _blocking(lambda: run_load_async(url, [LoadRequest(requests[0].prompt, 2)], [0.0], label="warm-up",
                                             **kwargs))
    runs: dict[str, list[LoadResult]] = {"A": [], "B": []}
    for side in order:
        n = len(runs[side]) + 1
        res = _blocking(lambda: run_load_async(urls[side], requests, arrivals, rate=rate,
                                               label=f"{label}, {side}{n if rounds > 1 else ''}", **kwargs))
        runs[side].append(res)
        if progress is not None:
            progress(side, n, res)
    return runs["A"], runs["B"]


def sweep(url: str, rates: Sequence[float], **kwargs: Any) -> list[LoadResult]:
    """``run_load`` at each rate in turn (same requests, same seed), lowest first."""
    rates = list(rates)
    if not rates:
        raise ValueError("give at least one rate")
    return [run_load(url, rate=r, **kwargs) for r in rates]


# -- reporting ------------------------------------------------------------------------------------

_COLUMNS = [("rate", "rate", "{:g}"), ("ok", "num_ok", "{:d}"), ("fail", "num_failed", "{:d}"),
            ("429", "num_rejected", "{:d}"),
            ("req/s", "throughput_req_s", "{:.2f}"), ("tok/s", "throughput_tok_s", "{:.1f}"),
            ("TTFT p50", "ttft_p50", "{:.3f}"), ("p95", "ttft_p95", "{:.3f}"), ("p99", "ttft_p99", "{:.3f}"),
            ("TPOT p50", "tpot_p50", "{:.3f}"), ("p95", "tpot_p95", "{:.3f}"),
            ("ITL p95", "itl_p95", "{:.3f}"), ("E2E p50", "e2e_p50", "{:.2f}"), ("p99", "e2e_p99", "{:.2f}"),
            ("goodput", "goodput", "{:.2f}"), ("SLO %", "slo_attainment", "{:.0%}")]


def format_table(results: LoadResult | Sequence[LoadResult]) -> str:
    """A fixed-width table, one row per run (latencies in seconds, goodput in requests/s)."""
    if isinstance(results, LoadResult):
        results = [results]
    rows = []
    for res in results:
        s = res.summary()
        row = []
        for _, key, fmt in _COLUMNS:
            v = s[key]
            if key == "rate" and v is None:
                row.append("trace")
            elif v is None:
                row.append("-")
            else:
                row.append(fmt.format(v))
        rows.append(row)
    heads = [h for h, _, _ in _COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    line = "  ".join(h.rjust(w) for h, w in zip(heads, widths))
    out = [line, "-" * len(line)] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    slo = results[0]
    out.append(f"latencies in seconds; goodput: requests/s with TTFT <= {slo.slo_ttft:g} s and "
               f"TPOT <= {slo.slo_tpot:g} s")
    return "\n".join(out)


# -- python -m minillm load ------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minillm load",
        description="Open-loop load test of an OpenAI-compatible server: Poisson arrivals, a trace, or a sweep "
                    "of rates; TTFT / TPOT / ITL / end-to-end percentiles, throughput and goodput. "
                    "A/B with two --url: the same arrivals (a trace, or --rate with --num-requests) are replayed "
                    "against server A, then against server B, one after the other and never at once (two servers "
                    "sharing this machine's cores would measure their contention); --rounds N alternates the order "
                    "(A B, B A, ...) so a drift of the machine's speed weighs on both sides. Then every metric: A, "
                    "B, B - A with a 95% bootstrap confidence interval, and a verdict for B: better, worse or "
                    "no difference.",
        epilog="examples: python -m minillm load --url http://127.0.0.1:8000 --sweep 0.5,1,2 --json out.json; "
               "an A/B: python -m minillm load --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 "
               "--trace traffic.jsonl --rounds 2",
    )
    p.add_argument("--url", action="append", required=True,
                   help="the server's base URL, e.g. http://127.0.0.1:8000; give it twice for an A/B (first A, then B)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="requests per second (Poisson arrivals); inf = all at once")
    mode.add_argument("--trace", help="a JSON-lines trace: arrival, prompt (or messages, or prompt_tokens), "
                                      "output_tokens; serve --record-trace writes one")
    mode.add_argument("--sweep", help="comma-separated rates, run one after another, e.g. 0.5,1,2,4")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate (default 32)")
    p.add_argument("--output-tokens", type=int, default=None,
                   help="tokens per request (default 32, or the workload's lengths with --prompts)")
    p.add_argument("--prompts", default=None,
                   help="a workload of minillm/bench/workload.py (uniform, chat, skewed...) for prompt lengths; "
                        "default: short instructions")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds arrivals and prompt order, and an A/B's bootstrap (default 0)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT, seconds (default 1.0)")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO on TPOT, seconds (default 0.2)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send the ignore_eos extension (for servers that reject it); lengths may vary")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY"),
                   help="sent as 'Authorization: Bearer <key>' (default: $MINILLM_API_KEY, else none)")
    p.add_argument("--json", default=None, help="write summaries and per-request records to this file (A/B: "
                                                "{'a': runs, 'b': runs, 'ab': the comparison})")
    ab = p.add_argument_group("A/B (two --url)")
    ab.add_argument("--rounds", type=int, default=None,
                    help="replays per side, in alternating order A B, B A, A B, ... (default 1: A then B)")
    ab.add_argument("--n-boot", type=int, default=None,
                    help="bootstrap resamples per metric for the 95%% confidence intervals (default 2000)")
    ab.add_argument("--no-warmup", action="store_true",
                    help="skip the one unmeasured warm-up request each server gets before the first replay")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    for name in ("slo_ttft", "slo_tpot", "timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    kw = dict(num_requests=args.num_requests, output_tokens=args.output_tokens, prompts=args.prompts,
              seed=args.seed, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, model=args.model,
              ignore_eos=not args.no_ignore_eos, temperature=args.temperature, timeout=args.timeout,
              api_key=args.api_key)
    _check_ab_args(args)
    if len(args.url) == 2:
        return _main_ab(args, kw)
    args.url = args.url[0]
    if args.sweep is not None:
        try:
            rates = [float(x) for x in args.sweep.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--sweep takes comma-separated rates such as 0.5,1,2; got {args.sweep!r}") from None
        results = []
        for r in rates:
            res = run_load(args.url, rate=r, **kw)
            results.append(res)
            print(format_table([res]).splitlines()[2], file=sys.stderr, flush=True)  # progress: the new row
    elif args.trace is not None:
        results = [run_load(args.url, trace=args.trace, **{k: v for k, v in kw.items()
                                                             if k not in ("num_requests", "output_tokens", "prompts")})]
    else:
        results = [run_load(args.url, rate=args.rate, **kw)]
    print(format_table(results))
    for res in results:
        for e in res.errors[:5]:
            print(f"[{res.label}] error: {e}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=1))
        print(f"wrote {args.json}")
    return 0 if all(r.summary()["num_failed"] == 0 for r in results) else 1


def _check_ab_args(args: argparse.Namespace) -> None:
    """The A/B flags fit the number of URLs; checked before any request is sent."""
    if len(args.url) > 2:
        raise ValueError(f"--url was given {len(args.url)} times: one URL is a load test, two are an A/B "
                         "(A, then B); compare more servers two at a time")
    if len(args.url) == 2:
        if args.sweep is not None:
            raise ValueError("--sweep with two --url: an A/B replays one trace or one --rate against both "
                             "servers; sweep each server on its own, or give --trace or --rate")
        for name, value in (("--rounds", args.rounds), ("--n-boot", args.n_boot)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value}")
        return
    for name, given in (("--rounds", args.rounds is not None), ("--n-boot", args.n_boot is not None),
                        ("--no-warmup", args.no_warmup)):
        if given:
            raise ValueError(f"{name} is for an A/B: give two --url (A, then B)")


def _main_ab(args: argparse.Namespace, kw: dict[str, Any]) -> int:
    """``load`` with two URLs: the A/B runs, each side's table, then the comparison."""
    from minillm.bench.ab import ab_to_json, compare, format_ab_table

    url_a, url_b = args.url
    rounds, n_boot = args.rounds or 1, args.n_boot or 2000

    def progress(side: str, n: int, res: LoadResult) -> None:  # the new row, as each replay ends
        print(f"[{side}{n if rounds > 1 else ''}] {format_table([res]).splitlines()[2]}", file=sys.stderr, flush=True)

    runs_a, runs_b = run_ab(url_a, url_b, rounds=rounds, warmup=not args.no_warmup, rate=args.rate,
                            trace=args.trace, progress=progress, **kw)
    for side, url, runs in (("A", url_a, runs_a), ("B", url_b, runs_b)):
        print(f"{side}: {url} ({len(runs)} replay{'s' if len(runs) > 1 else ''} of {runs[0].label.split(',')[0]})")
        print(format_table(runs))
        for res in runs:
            for e in res.errors[:5]:
                print(f"[{side}] error: {e}", file=sys.stderr)
        print()
    rows = compare(runs_a, runs_b, n_boot=n_boot, seed=args.seed)
    print(format_ab_table(rows))
    if rounds == 1:
        print("one replay per side: the intervals hold the requests' noise, not how much replays of one server "
              "differ; --rounds 3 or more measures that too")
    if args.json:
        about = dict(url_a=url_a, url_b=url_b, rounds=rounds, order="".join(ab_order(rounds)), n_boot=n_boot,
                     seed=args.seed, conf=0.95)
        Path(args.json).write_text(json.dumps({"a": [r.to_json() for r in runs_a], "b": [r.to_json() for r in runs_b],
                                               "ab": ab_to_json(rows, **about)}, indent=1))
        print(f"wrote {args.json}")
    return 0 if all(r.summary()["num_failed"] == 0 for r in runs_a + runs_b) else 1


__all__ = ["LoadRequest", "LoadResult", "poisson_arrivals", "make_requests", "load_trace", "percentile", "goodput",
           "meets_slo", "run_load", "run_load_async", "run_ab", "ab_order", "sweep", "format_table", "main"]
