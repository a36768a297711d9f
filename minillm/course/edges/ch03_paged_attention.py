"""Chapter 3's edges: prompts that end on a block edge, a decode that opens a new block,
blocks recycled tail first (so a later block table runs backwards), a pool that runs dry and
preempts the newest request, a prefill chunk that starts mid-block, never-written slots that
hold NaN, and slot 0, the first slot of the cache.

The block pieces (``blocks_needed``, ``allocate_blocks``, ``free_blocks``, ``choose_victim``)
run on the simulator's virtual clock (no model): what must match is each step's rows and KV
bytes, the block table of every running request after it, the preemptions and the tokens.
Slots, attention and the K/V store need a forward: a tiny random Llama (vocabulary 64, three
layers, the torch attention backend) serves a handful of requests, and its step schedule and
greedy tokens must match; a wrong slot or a wrong attention weight changes the tokens.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Any, Sequence

import torch

from . import EdgeCase
from ._engine import schedule

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a Triton K/V store runs interpreted on the CPU

BS = 4  # tokens per block in every case
BLOCKS = ("blocks_needed", "allocate_blocks", "free_blocks")

_TINY: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                             num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=2)
_weights: dict[str, torch.Tensor] = {}


def _tiny_weights() -> dict[str, torch.Tensor]:
    """Seeded random weights, scaled so that greedy tokens are sensitive to every attention weight."""
    if not _weights:
        from minillm import loader
        from minillm.config import ModelConfig

        raw = loader.dummy_weights(ModelConfig(**_TINY), 0)
        _weights.update({k: v if "norm" in k else v * 10.0 for k, v in raw.items()})
    return _weights


def _prompt(i: int, n: int) -> list[int]:
    return [3 + (7 * i + 5 * j) % 61 for j in range(n)]


def _stepped(eng, requests) -> dict[str, Any]:
    """Step ``eng`` through ``requests``; per step, the block table of every running request after it."""
    tables = []
    try:
        for r in requests:
            eng.scheduler.add(r)
        while eng.has_unfinished():
            eng.step()
            tables.append(tuple((r.request_id, tuple(r.block_ids)) for r in eng.scheduler.running))
    finally:
        for r in requests:  # a stopped run leaves no request holding blocks
            if not r.is_finished:
                eng.abort(r)
    # The order is the order a difference is reported in: who was preempted says more than the
    # KV bytes that follow from it, and a block table more than the tokens.
    return {"preemptions": [r.metrics.num_preemptions for r in requests], "block tables": tables,
            "schedule": schedule(eng.step_records), "tokens": [list(r.output_token_ids) for r in requests]}


def simulated_blocks(prompt_lens: Sequence[int], output_lens: Sequence[int], max_num_seqs: int,
                     **options: Any) -> dict[str, Any]:
    """The paged engine on the virtual clock (``bench.cost_model.simulate``'s set-up, kept here so
    the block tables can be read after every step). Requests are queued in the order given."""
    from minillm.bench.cost_model import CostModel, CostModelRunner
    from minillm.clock import VirtualClock
    from minillm.config import EngineConfig, ModelConfig
    from minillm.engine import LLMEngine
    from minillm.resolve import resolve
    from minillm.sampling_params import SamplingParams
    from minillm.scheduler import build_scheduler

    model = ModelConfig()
    longest = max(p + n for p, n in zip(prompt_lens, output_lens))
    config = EngineConfig(engine="paged", max_num_seqs=max_num_seqs, max_model_len=longest, dummy_weights=True,
                          device="cpu", dtype="float32", block_size=BS, **options)
    resolved = resolve(config, model)
    clock = VirtualClock()
    eng = LLMEngine(config, resolved, model, None, build_scheduler(config, resolved, model.eos_token_id),
                    CostModelRunner(CostModel(), clock), clock=clock)
    requests = [eng.make_request(_prompt(i, p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                 arrival_time=0.0, request_id=str(i))
                for i, (p, n) in enumerate(zip(prompt_lens, output_lens))]
    return _stepped(eng, requests)


def tiny_model(prompt_lens: Sequence[int], output_lens: Sequence[int], nan_cache: bool = False,
               triton_device: bool = False, **options: Any) -> dict[str, Any]:
    """A tiny random Llama on the paged engine: its schedule, block tables and greedy tokens.
    ``nan_cache``: every cache slot starts as NaN, as memory fresh from ``torch.empty`` may.
    ``triton_device``: run where a Triton kernel runs (the GPU, unless the interpreter is on),
    else on the CPU."""
    from minillm.attention import triton_interprets
    from minillm.config import EngineConfig, ModelConfig
    from minillm.engine import build_engine
    from minillm.sampling_params import SamplingParams

    device = "cuda" if triton_device and torch.cuda.is_available() and not triton_interprets() else "cpu"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest and never waits on busy workers
    try:
        config = EngineConfig(**(dict(engine="paged", device=device, dtype="float32", block_size=BS,
                                      attention_backend="torch") | options))
        eng = build_engine(config, weights=_tiny_weights(), tokenizer=None, model_config=ModelConfig(**_TINY))
        if nan_cache:
            for k, v in eng.runner.kv_caches:
                k.fill_(float("nan"))
                v.fill_(float("nan"))
        requests = [eng.make_request(_prompt(i, p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                     arrival_time=0.0, request_id=str(i))
                    for i, (p, n) in enumerate(zip(prompt_lens, output_lens))]
        return _stepped(eng, requests)
    finally:
        torch.set_num_threads(threads)


CASES = [
    # Prompts of 8 and 4 tokens end on a block edge: their first decode opens a new block. Two
    # slots and 6 blocks, so requests 2 and 3 get blocks that 0 and 1 gave back tail first:
    # request 2's table runs backwards (5, 3, 1).
    EdgeCase("prompts that end on a block edge; blocks freed tail first and handed out again",
             BLOCKS, partial(simulated_blocks, [8, 4, 7, 5], [3, 6, 5, 4], 2, num_blocks=6)),
    # 8 blocks for requests of 12, 4 and 8 tokens decoding 9 more: the pool runs dry and the
    # newest (2) is preempted, though 0 is the oldest and holds the most blocks and 1 has
    # computed the fewest tokens; 2 recomputes once 0 and 1 are done, in recycled blocks.
    EdgeCase("the pool runs dry: the newest running request is preempted, then recomputed",
             BLOCKS + ("choose_victim",), partial(simulated_blocks, [12, 4, 8], [9, 9, 9], 3, num_blocks=8)),
    # Two slots and 8 blocks: the later requests get recycled blocks, so their tables are out of
    # order (request 3's is 4, 3, 5); a budget of 6 tokens cuts prompts into chunks that start
    # and end mid-block; the contexts of the decodes end on block edges and inside blocks.
    EdgeCase("recycled blocks out of order; prefill chunks that start mid-block; contexts on block edges",
             ("slot_mapping", "paged_decode_attention"),
             partial(tiny_model, [9, 4, 7, 10], [7, 5, 6, 4], max_num_seqs=2, num_blocks=8, max_model_len=20,
                     enable_chunked_prefill=True, max_num_batched_tokens=6)),
    # The engine's caches start as zeros; the contract lets a never-written slot hold anything,
    # NaN included, and here they do: masking a garbage key's weight is not enough (0 * NaN).
    EdgeCase("never-written cache slots hold NaN (memory fresh from torch.empty)",
             ("paged_decode_attention",),
             partial(tiny_model, [6, 4], [6, 5], nan_cache=True, max_num_seqs=2, num_blocks=8, max_model_len=16)),
    # The first prompt's first token goes to slot 0; K comes from a fused projection (strided rows).
    EdgeCase("slot 0 of block 0 is written; K and V rows are strided views of the QKV projection",
             ("store_kv_triton",), partial(tiny_model, [5, 3], [3, 2], triton_device=True, max_num_seqs=2,
                                           num_blocks=8, max_model_len=16)),
]
