"""Chapter 6's edges: a cached run broken by an eviction, a block cached under another parent,
a one-block prompt, eviction while never-cached blocks are free, and the priority order at
the timeouts' edges (a wait of exactly the timeout, two classes timed out, a request queued
ahead of an earlier arrival, one that has not arrived yet).

Each case runs the paged engine on the simulator's virtual clock (no model: every sampled
token is 0, so a request's output blocks are predictable) with one batch slot, so the
requests run one after another and the cache holds what the earlier ones left. What must
match: each step's rows, its prefix-hit tokens, the cached and evictable block counts, and
the block table of every running request (so a different eviction is seen at once).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Sequence

from . import EdgeCase

LOOKUP = ("longest_cached_prefix",)
ALLOCATE = ("allocate_with_eviction",)
ADMISSION = ("admission_order",)


def paged_run(prompts: Sequence[Sequence[int]], output_lens: Sequence[int], max_num_seqs: int = 1,
              arrivals: Sequence[float] | None = None, classes: Sequence[str] | None = None,
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
    longest = max(len(p) + n for p, n in zip(prompts, output_lens))
    config = EngineConfig(engine="paged", max_num_seqs=max_num_seqs, max_model_len=longest, dummy_weights=True,
                          device="cpu", dtype="float32", **options)
    resolved = resolve(config, model)
    clock = VirtualClock()
    eng = LLMEngine(config, resolved, model, None, build_scheduler(config, resolved, model.eos_token_id),
                    CostModelRunner(CostModel(), clock), clock=clock)
    arrivals = list(arrivals) if arrivals is not None else [0.0] * len(prompts)
    classes = list(classes) if classes is not None else ["standard"] * len(prompts)
    requests = [eng.make_request(list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, priority=c),
                                 arrival_time=t, request_id=str(i))
                for i, (p, n, t, c) in enumerate(zip(prompts, output_lens, arrivals, classes))]
    steps = []
    try:
        for r in requests:
            eng.scheduler.add(r)
        while eng.has_unfinished():
            before = len(eng.step_records)
            eng.step()
            for s in eng.step_records[before:]:
                tables = tuple((r.request_id, tuple(r.block_ids)) for r in eng.scheduler.running)
                step = {"rows": tuple(zip(s.request_ids, s.num_new_tokens)), "hit tokens": s.prefix_hit_tokens,
                        "cached blocks": s.num_cached_blocks, "evictable blocks": s.num_evictable_blocks,
                        "block tables": tables}
                if options.get("kv_offload"):  # the host tier's part of the step (chapter 9)
                    step["host"] = (s.host_hit_tokens, s.kv_blocks_offloaded, s.kv_blocks_restored)
                steps.append(step)
    finally:
        for r in requests:  # a stopped run leaves no request holding blocks
            if not r.is_finished:
                eng.abort(r)
    return {"steps": steps, "tokens": [list(r.output_token_ids) for r in requests],
            "evictions": eng.scheduler.block_manager.num_evictions}


BS = 4  # tokens per block in every case
CACHING = dict(block_size=BS, enable_prefix_caching=True)
A0 = [3, 4, 5, 6]  # one full block
T1 = [7, 8, 9, 10]  # another

# 1. Two one-block prompts A0: the second may share nothing (max_blocks = (4 - 1) // 4 = 0) and
#    computes its own copy, which stays uncached, and its outputs (token 0) fill a block chained
#    from A0 that is cached. A 17-token prompt then needs the whole free list and one eviction:
#    the LRU block is the first A0, so the cache holds A0's successor without A0 itself. The
#    last prompt, A0 + that successor + 1, must miss at its first block and stop there.
RUN_BROKEN = ([A0, A0, [20 + i for i in range(17)], A0 + [0] * BS + [9]], [1, 6, 2, 2])

# 2. A prompt starting with A0, one starting with T1, then A0 + T1 + 1: its block T1 is cached
#    only as a first block (another parent), so the run is A0 alone; then a one-block prompt A0
#    (max_blocks 0: nothing may be shared although A0 is cached).
OTHER_PARENT = ([A0 + [11], T1 + [12], A0 + T1 + [13], A0], [2, 2, 2, 3])

# 3. Eviction order. Three prompts leave their blocks cached (evictable, least recently freed
#    first); a fresh prompt then needs more than the never-cached free blocks; the prompts that
#    come back show which cached blocks survived. Blocks of 4 tokens, 12 in all.
EVICTION = ([A0 + T1 + [1], [30, 31, 32, 33, 34], [40, 41, 42, 43, 44, 45, 46, 47, 48],
             [50 + i for i in range(30)], A0 + T1 + [2], [40, 41, 42, 43, 44, 45, 46, 47, 49]],
            [2, 2, 2, 3, 2, 2])

# 4. Priority (one slot): every request arrives at 0.0, so at the first step 'now - arrival' is
#    exactly 0.0; the standard class's timeout 0.0 is then reached, not passed.
TIMEOUT_AT_ZERO = dict(queue_timeouts={"interactive": 10.0, "standard": 0.0, "batch": 10.0})
# 5. Classes that time out fast (standard 0.01 s, batch 0.02 s, a step costs 0.03 s or more):
#    by the second admission a batch job queued first and a standard one behind it have both
#    timed out, and an interactive request (never times out) arrives later.
BOTH_LATE = dict(queue_timeouts={"interactive": 10.0, "standard": 0.01, "batch": 0.02})


def _priority_run(prompt_lens, output_lens, arrivals, classes, timeouts, max_num_seqs=1):
    prompts = [[60 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate(prompt_lens)]
    return paged_run(prompts, output_lens, max_num_seqs, arrivals, classes, scheduling_policy="priority",
                     block_size=BS, **timeouts)


CASES = [
    EdgeCase("a cached run broken by an eviction: A0's successor is cached, A0 itself is not",
             LOOKUP, partial(paged_run, *RUN_BROKEN, num_blocks=6, **CACHING)),
    EdgeCase("a block cached only as another prompt's first block; a one-block prompt (max_blocks 0)",
             LOOKUP, partial(paged_run, *OTHER_PARENT, num_blocks=16, **CACHING)),
    EdgeCase("an allocation needs more than the never-cached free blocks: evict the least recently used",
             ALLOCATE, partial(paged_run, *EVICTION, num_blocks=12, **CACHING)),
    EdgeCase("a standard request that waited exactly its timeout (0.0 s) has not timed out",
             ADMISSION, partial(_priority_run, [6, 5, 7], [2, 2, 2], [0.0, 0.0, 0.0],
                                ["standard", "interactive", "batch"], TIMEOUT_AT_ZERO)),
    EdgeCase("two classes timed out (batch queued first), a fresh interactive request, one not arrived yet",
             ADMISSION, partial(_priority_run, [5, 6, 5, 7, 4], [3, 2, 2, 2, 2], [0.0, 0.0, 0.0, 0.05, 5.0],
                                ["interactive", "batch", "standard", "interactive", "standard"], BOTH_LATE)),
    EdgeCase("a request queued ahead of one of its class that arrived earlier",
             ADMISSION, partial(_priority_run, [5, 6, 4], [2, 2, 2], [0.0, 0.02, 0.01],
                                ["batch", "standard", "standard"],
                                dict(queue_timeouts={"interactive": 10.0, "standard": 10.0, "batch": 10.0}))),
]
