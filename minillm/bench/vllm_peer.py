"""Runs one bench workload through vLLM, in vLLM's own Python (``make peer-vllm``).

    python minillm/bench/vllm_peer.py JOB.json RESULT.json

``python -m minillm bench --engine ...,vllm`` writes JOB.json and starts this file as a
script in another interpreter: vLLM pins its own torch and transformers, so this file
imports nothing of minillm (only the standard library and vllm) and speaks JSON.

JOB.json::

    {"model": "<Hugging Face model folder>", "dtype": "float32", "max_num_seqs": 8,
     "max_model_len": 1024, "max_num_batched_tokens": 1024, "kv_cache_memory_bytes": ...,
     "enforce_eager": false, "skip_tokenizer_init": false, "seed": 0,
     "requests": [{"prompt_token_ids": [...], "max_tokens": 20, "arrival_time": 0.0}, ...]}

Every request is greedy, exactly ``max_tokens`` new tokens with EOS ignored, and its
prompt goes in as token ids (vLLM adds no BOS and applies no template to those). Arrivals
are replayed in real time (``arrival_time`` seconds after the start). The run drives
``LLMEngine.step`` itself and stamps every token with the time the step that returned
it ended: the same definition of TTFT / TPOT / ITL as minillm's engines.

RESULT.json: ``start`` and ``end`` (perf_counter seconds of this process), per request
``token_ids``, ``token_times``, ``arrival_time``, ``finish_time``; and what vLLM ran
with (version, dtype, device, KV cache blocks).
"""
from __future__ import annotations

import json
import sys
import time


def _engine_settings(llm) -> dict:
    """What vLLM resolved: dtype, KV cache size, scheduler settings (None where not found)."""
    out: dict = {}
    cfg = getattr(llm.llm_engine, "vllm_config", None)
    if cfg is None:
        return out
    mc, cc, sc = cfg.model_config, cfg.cache_config, cfg.scheduler_config
    out["dtype"] = str(mc.dtype).removeprefix("torch.")
    out["device"] = str(getattr(getattr(cfg, "device_config", None), "device_type", None) or "")
    num_blocks, block_size = getattr(cc, "num_gpu_blocks", None), getattr(cc, "block_size", None)
    out["num_blocks"], out["block_size"] = num_blocks, block_size
    try:  # K and V of one token, every layer, in the cache dtype
        kv_per_token = 2 * mc.get_num_layers(cfg.parallel_config) * mc.get_num_kv_heads(cfg.parallel_config) \
            * mc.get_head_size() * mc.dtype.itemsize if cc.cache_dtype == "auto" else None
    except Exception:
        kv_per_token = None
    out["kv_cache_bytes"] = (num_blocks * block_size * kv_per_token
                             if num_blocks and block_size and kv_per_token else None)
    out["enable_chunked_prefill"] = getattr(sc, "enable_chunked_prefill", None)
    out["max_num_batched_tokens"] = getattr(sc, "max_num_batched_tokens", None)
    out["async_scheduling"] = getattr(sc, "async_scheduling", None)
    out["enforce_eager"] = getattr(mc, "enforce_eager", None)
    return out


def run(engine, requests: list[dict], params_for, now=time.perf_counter,
        heartbeat_s: float | None = None) -> tuple[float, float, list[dict]]:
    """Replay ``requests`` through ``engine`` (a vLLM LLMEngine); per request its tokens and times.

    ``heartbeat_s``: print the tokens done so far to stderr every that many seconds."""
    recs = [{"token_ids": [], "token_times": [], "finish_time": None} for _ in requests]
    ids = {f"req{i}": i for i in range(len(requests))}
    order = sorted(range(len(requests)), key=lambda i: requests[i].get("arrival_time", 0.0))
    start = now()
    for i, r in enumerate(requests):
        recs[i]["arrival_time"] = start + r.get("arrival_time", 0.0)
    nxt = 0
    total, done, last_beat = sum(r["max_tokens"] for r in requests), 0, start
    while nxt < len(order) or engine.has_unfinished_requests():
        t = now()
        while nxt < len(order) and recs[order[nxt]]["arrival_time"] <= t:
            i = order[nxt]
            engine.add_request(f"req{i}", {"prompt_token_ids": list(requests[i]["prompt_token_ids"])},
                               params_for(requests[i]))
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, recs[order[nxt]]["arrival_time"] - now()))
            continue
        outs = engine.step()
        t = now()
        for o in outs:
            rid = o.request_id
            i = ids.get(rid)
            if i is None:  # some versions append a suffix to the caller's id
                i = ids[rid.rsplit("-", 1)[0]]
            new = [tok for c in o.outputs[:1] for tok in c.token_ids]
            recs[i]["token_ids"].extend(new)
            recs[i]["token_times"].extend([t] * len(new))
            done += len(new)
            if o.finished:
                recs[i]["finish_time"] = t
        if heartbeat_s and t - last_beat >= heartbeat_s:
            print(f"vllm: {done}/{total} tokens, {t - start:.0f} s", file=sys.stderr, flush=True)
            last_beat = t
    end = max((r["finish_time"] or start for r in recs), default=start)
    return start, end, recs


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python vllm_peer.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(model=job["model"], tokenizer=job["model"], dtype=job["dtype"], seed=job.get("seed", 0),
              max_num_seqs=job["max_num_seqs"], max_model_len=job["max_model_len"],
              max_num_batched_tokens=job.get("max_num_batched_tokens"),
              kv_cache_memory_bytes=job.get("kv_cache_memory_bytes"),
              enable_prefix_caching=False,  # as minillm's continuous engine: every prompt is prefilled
              enforce_eager=job.get("enforce_eager", False),
              skip_tokenizer_init=job.get("skip_tokenizer_init", False),
              disable_log_stats=True)
    engine = llm.llm_engine

    def params_for(r: dict) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.DELTA)

    # Warm up (first-call allocations, compilation), outside the measurement, as minillm does.
    run(engine, [{"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 2}], params_for)
    start, end, recs = run(engine, job["requests"], params_for, heartbeat_s=job.get("heartbeat_s"))
    result = {"vllm_version": vllm.__version__, "start": start, "end": end, "requests": recs,
              **_engine_settings(llm)}
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
