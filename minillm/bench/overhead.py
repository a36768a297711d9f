"""What the server adds to latency at low load: TTFT and TPOT through HTTP vs in-process.

    python -m minillm.bench.overhead --num-requests 8 --max-tokens 32

One engine, one run: each prompt is generated once with ``LLM.generate`` in this process
and once through the OpenAI-compatible server (streaming, one request at a time, the same
engine behind it), alternating which goes first so that drift in the machine's speed
(other jobs on shared cores) falls on both sides alike. Both are timed as their caller
sees them:

    in-process   TTFT: before generate() -> the first token's timestamp; TPOT from token timestamps
    server       TTFT: before the HTTP request -> first streamed chunk;   TPOT from chunk arrivals

So the server's figures include HTTP, JSON, the hop to the engine thread and back, and the
client's own parsing, all in this one process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from .loadgen import DEFAULT_PROMPTS


def _server_once(http: Any, url: str, prompt: str, max_tokens: int) -> tuple[float, float | None, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times, n = [], None
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    n = n or len(times)
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return times[0] - t0, tpot, n


def _inproc_once(llm: Any, prompt: str, max_tokens: int) -> tuple[float, float | None, int]:
    from ..sampling_params import SamplingParams

    t0 = time.perf_counter()  # the engine's clock is time.perf_counter too
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    return out.metrics.first_token_time - t0, out.metrics.tpot, len(out.token_ids)


def overhead_check(num_requests: int = 8, max_tokens: int = 32, warmup: int = 2, prompts: list[str] | None = None,
                   llm: Any = None, **engine_kwargs: Any) -> dict[str, Any]:
    """Median TTFT and TPOT in-process vs through the server, and the server's added fraction.

    ``llm``: an ``LLM`` to reuse (its weights loaded); else one is built from
    ``engine_kwargs`` (default: the paged engine, max_model_len 1024).
    """
    import httpx

    from ..engine import LLM
    from ..serving.async_llm import AsyncLLM
    from ..serving.server import serve_in_background

    if llm is None:
        llm = LLM(**{"engine": "paged", "max_model_len": 1024, **engine_kwargs})
    elif engine_kwargs:
        raise ValueError("give engine options or llm, not both")
    prompts = list(prompts or DEFAULT_PROMPTS)
    served = AsyncLLM.from_llm(llm)
    rows: dict[str, list] = {"inproc": [], "server": []}
    try:
        with serve_in_background(async_llm=served) as handle, httpx.Client(timeout=600) as http:
            for i in range(warmup):  # first forwards are slower (allocator, caches): not measured
                _inproc_once(llm, prompts[i % len(prompts)], max_tokens)
                _server_once(http, handle.url, prompts[i % len(prompts)], max_tokens)
            for i in range(num_requests):
                p = prompts[i % len(prompts)]
                order = ("inproc", "server") if i % 2 == 0 else ("server", "inproc")
                for side in order:
                    once = _inproc_once(llm, p, max_tokens) if side == "inproc" else _server_once(
                        http, handle.url, p, max_tokens)
                    rows[side].append(once)
    finally:
        served.shutdown()
    result: dict[str, Any] = {"num_requests": num_requests, "max_tokens": max_tokens,
                              "engine": llm.config.engine, "device": str(llm.engine.device)}
    for side, rs in rows.items():
        assert all(n == max_tokens for _, _, n in rs), f"{side}: a request did not produce {max_tokens} tokens"
        result[f"{side}_ttft_p50"] = statistics.median(t for t, _, _ in rs)
        result[f"{side}_tpot_p50"] = statistics.median(t for _, t, _ in rs)
        result[f"{side}_ttft_mean"] = statistics.fmean(t for t, _, _ in rs)
        result[f"{side}_tpot_mean"] = statistics.fmean(t for _, t, _ in rs)
    for j, m in enumerate(("ttft", "tpot")):
        result[f"{m}_overhead"] = result[f"server_{m}_p50"] / result[f"inproc_{m}_p50"] - 1.0
        # Paired: the same prompt, back to back, so prompt length and machine drift cancel.
        result[f"{m}_overhead_paired"] = statistics.median(
            s[j] / a[j] - 1.0 for a, s in zip(rows["inproc"], rows["server"]))
        result[f"{m}_added_ms_paired"] = 1e3 * statistics.median(
            s[j] - a[j] for a, s in zip(rows["inproc"], rows["server"]))
    return result


def format_overhead(r: dict[str, Any]) -> str:
    lines = [f"{r['num_requests']} requests one at a time, {r['max_tokens']} tokens each, {r['engine']} engine "
             f"on {r['device']} (medians; means in brackets)",
             f"{'':8}{'in-process':>20}{'server':>20}{'added':>10}{'paired':>10}{'paired ms':>11}"]
    for m in ("ttft", "tpot"):
        a, b = r[f"inproc_{m}_p50"], r[f"server_{m}_p50"]
        am, bm = r[f"inproc_{m}_mean"], r[f"server_{m}_mean"]
        lines.append(f"{m.upper():8}{f'{a * 1e3:.1f} ms ({am * 1e3:.1f})':>20}{f'{b * 1e3:.1f} ms ({bm * 1e3:.1f})':>20}"
                     f"{r[f'{m}_overhead']:>+10.1%}{r[f'{m}_overhead_paired']:>+10.1%}"
                     f"{r[f'{m}_added_ms_paired']:>+11.2f}")
    lines.append("added: ratio of the medians; paired: median over prompts of server / in-process (and of "
                 "server - in-process), same prompt back to back")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.overhead",
                                description="Server TTFT/TPOT vs in-process LLM.generate at low load, one engine.")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--engine", default="paged")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    kw = {k: v for k, v in dict(engine=args.engine, device=args.device, dtype=args.dtype,
                                max_model_len=args.max_model_len).items() if v is not None}
    r = overhead_check(args.num_requests, args.max_tokens, args.warmup, **kw)
    print(format_overhead(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
