"""Multi-turn chat in a tight KV pool: no prefix cache, the device's LRU cache alone, and a host tier.

    python -m minillm.bench.offload_measure                     # 8 conversations x 4 turns, 2 rounds
    python -m minillm.bench.offload_measure --conversations 10 --turns 5 --rounds 3 --json out.json

Conversations take turns round-robin (every conversation's turn 1, then every turn 2...),
and each turn resends the whole history: a system prompt, the questions so far and the
model's own answers (greedy), plus a new question. The device pool holds about two
conversations, so by the time a user comes back the device's LRU has given their blocks
to the others. Three engines, each with the same pool:

* ``none``: no prefix cache, every turn computes its whole prompt;
* ``lru``: prefix caching (chapter 6), the evictable pool reused least recently used first;
* ``host``: the same, plus a host tier (``kv_offload``) large enough for every conversation.

Each request runs alone (one at a time), so its TTFT is its own prefill. Each round runs
the three engines' whole traces back to back in an order that alternates (none, lru, host,
then host, lru, none...), so drift in the machine's speed falls on all alike: compare
ratios within a run. All three must give the same greedy tokens.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from minillm.bench.summary import percentiles

CONFIGS = ("none", "lru", "host")


def engine_options(config: str, num_blocks: int, host_blocks: int, idle_s: float = 2.0) -> dict[str, Any]:
    """``LLM`` options of one of ``CONFIGS`` (the pool and block size are the same for all)."""
    opts: dict[str, Any] = dict(engine="paged", block_size=16, max_model_len=512, max_num_seqs=1,
                                num_blocks=num_blocks)
    if config in ("lru", "host"):
        opts["enable_prefix_caching"] = True
    if config == "host":
        opts["kv_offload"] = {"host_blocks": host_blocks, "idle_s": idle_s}
    return opts


def conversations(n: int, turns: int, seed: int = 0, system_len: int = 64, question_len: int = 32,
                  vocab: tuple[int, int] = (1000, 20000)) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's system prompt and its ``turns`` questions, as token ids (seeded)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(*vocab) for _ in range(system_len)] for _ in range(n)]
    questions = [[[rng.randrange(*vocab) for _ in range(question_len)] for _ in range(turns)] for _ in range(n)]
    return systems, questions


def run_conversations(engine, systems, questions, max_tokens: int = 16, progress=None) -> list[dict[str, Any]]:
    """Play every conversation's turns round-robin on ``engine``; one record per request:
    conversation, turn, prompt tokens, tokens computed (not found in a cache), TTFT, output."""
    from minillm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    history = [list(s) for s in systems]
    sched = engine.scheduler
    records = []
    for turn in range(len(questions[0])):
        for c, qs in enumerate(questions):
            prompt = history[c] + qs[turn]
            hits_before, host_before = getattr(sched, "prefix_hit_tokens", 0), getattr(sched, "host_hit_tokens", 0)
            req = engine.make_request(prompt, params, arrival_time=engine.clock.now())
            out = engine.run([req])[0]
            m = req.metrics
            hits = getattr(sched, "prefix_hit_tokens", 0) - hits_before
            records.append(dict(conversation=c, turn=turn, prompt_tokens=len(prompt), computed=len(prompt) - hits,
                                host_hit_tokens=getattr(sched, "host_hit_tokens", 0) - host_before,
                                ttft=m.first_token_time - m.arrival_time, tokens=list(out.token_ids)))
            history[c] = prompt + list(out.token_ids)
            if progress is not None:
                progress.update(1)
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = percentiles([r["ttft"] for r in records], (50, 95))
    return dict(requests=len(records), prompt_tokens=sum(r["prompt_tokens"] for r in records),
                computed_tokens=sum(r["computed"] for r in records),
                host_hit_tokens=sum(r["host_hit_tokens"] for r in records),
                ttft_p50=ttft["p50"], ttft_p95=ttft["p95"])


def measure(num_conversations: int = 8, turns: int = 4, rounds: int = 2, num_blocks: int = 36,
            host_blocks: int | None = None, max_tokens: int = 16, seed: int = 0,
            weights: dict | None = None, tokenizer: Any = None, progress: bool = True,
            device: str = "cpu", dtype: str = "float32", model_config: Any = None) -> dict[str, Any]:
    """Run the three engines ``rounds`` times, alternating; medians of each figure over rounds.

    Without ``weights`` the model file's weights and tokenizer; with ``weights`` and their
    ``model_config`` (dummy weights on a GPU, say) no model file or tokenizer is needed."""
    from minillm import loader
    from minillm.config import EngineConfig
    from minillm.engine import build_engine

    if weights is None:
        weights = loader.load_weights(None)
        tokenizer = loader.load_tokenizer(None) if tokenizer is None else tokenizer
    systems, questions = conversations(num_conversations, turns, seed)
    longest = len(systems[0]) + turns * (len(questions[0][0]) + max_tokens)
    host_blocks = host_blocks or num_conversations * (longest // 16 + 1)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=rounds * len(CONFIGS) * num_conversations * turns, desc="multi-turn", unit="req")
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    tokens: dict[str, list] = {}
    last: dict[str, Any] = {}
    for rnd in range(rounds):
        for config in (CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]):
            engine = build_engine(EngineConfig(device=device, dtype=dtype,
                                               **engine_options(config, num_blocks, host_blocks)),
                                  weights=weights, tokenizer=tokenizer, model_config=model_config)
            records = run_conversations(engine, systems, questions, max_tokens, bar)
            runs[config].append(summarize(records))
            tokens[config] = [r["tokens"] for r in records]
            last[config] = (engine, records)
    if bar is not None:
        bar.close()
    med = {c: {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]} for c in CONFIGS}
    host_engine = last["host"][0]
    snap = host_engine.snapshot().kv_offload
    return dict(
        setup=dict(conversations=num_conversations, turns=turns, rounds=rounds, num_blocks=num_blocks,
                   block_size=16, host_blocks=host_blocks, max_tokens=max_tokens, longest_prompt=longest),
        medians=med, rounds=runs,
        same_tokens=tokens["none"] == tokens["lru"] == tokens["host"],
        computed_ratio=med["host"]["computed_tokens"] / med["lru"]["computed_tokens"],
        ttft_p50_speedup=med["lru"]["ttft_p50"] / med["host"]["ttft_p50"],
        copies=dict(blocks_out=snap.blocks_out, blocks_in=snap.blocks_in, bytes_out=snap.bytes_out,
                    bytes_in=snap.bytes_in, copy_seconds=snap.copy_seconds),
        per_turn={c: [[r["computed"] for r in last[c][1] if r["turn"] == t] for t in range(turns)] for c in CONFIGS},
        ttfts={c: [r["ttft"] for r in last[c][1]] for c in CONFIGS})


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'engine':<6} {'prompt tok':>10} {'computed':>9} {'from host':>9} {'TTFT p50 ms':>11} {'TTFT p95 ms':>11}"]
    for c in CONFIGS:
        m = result["medians"][c]
        lines.append(f"{c:<6} {m['prompt_tokens']:>10.0f} {m['computed_tokens']:>9.0f} {m['host_hit_tokens']:>9.0f} "
                     f"{m['ttft_p50'] * 1e3:>11.1f} {m['ttft_p95'] * 1e3:>11.1f}")
    cp = result["copies"]
    lines.append(f"host tier vs LRU alone: computed x{result['computed_ratio']:.2f}, TTFT p50 "
                 f"{result['ttft_p50_speedup']:.2f}x faster; same greedy tokens: {result['same_tokens']}")
    lines.append(f"copies (last host run): {cp['blocks_out']} blocks out ({cp['bytes_out'] / 1e6:.1f} MB), "
                 f"{cp['blocks_in']} in ({cp['bytes_in'] / 1e6:.1f} MB), {cp['copy_seconds'] * 1e3:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.offload_measure", description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of the three engines (default 2)")
    p.add_argument("--num-blocks", type=int, default=36, help="the device pool, blocks of 16 tokens (default 36)")
    p.add_argument("--host-blocks", type=int, default=None, help="the host pool (default: every conversation)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    result = measure(args.conversations, args.turns, args.rounds, args.num_blocks, args.host_blocks,
                     args.max_tokens, args.seed)
    print(format_table(result))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in result.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
