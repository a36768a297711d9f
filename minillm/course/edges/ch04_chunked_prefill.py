"""Chapter 4's edges: the decodes use up the budget exactly while a prompt waits; a prompt
longer than what is left goes in chunks beside the decodes while a shorter one waits behind
it; several prompts share a step, the last one cut mid-block; the same under the priority
policy (whose chunks are asked for one request at a time).

Every case runs the paged engine with chunked prefill on the simulator's virtual clock (no
model); what must match is each step's rows (who fed how many tokens) and KV bytes, the
preemptions and the tokens.
"""
from __future__ import annotations

from functools import partial

from . import EdgeCase
from ._engine import simulated

SPLIT = ("split_budget",)
CHUNKED = dict(enable_chunked_prefill=True, block_size=4)

CASES = [
    # Budget 4: step 1 feeds 3 + 1, step 2 two decodes + 1 + 1, step 3 four decodes, exactly the
    # budget, while the 6-token prompt waits (it gets 0 tokens, and nothing is wrong).
    EdgeCase("the decodes use up the budget exactly while a prompt waits",
             SPLIT, partial(simulated, [3, 1, 1, 1, 6], [4, 3, 3, 2, 2], "paged", 4, max_num_batched_tokens=4,
                            **CHUNKED)),
    # Budget 12: the 30-token prompt takes the 7 tokens the first prompt leaves, then 11 a step
    # beside one decode; the 4-token prompt behind it waits until the last chunk leaves room.
    EdgeCase("a long prompt goes in chunks beside the decodes; a shorter one waits behind it",
             SPLIT, partial(simulated, [5, 30, 4], [8, 3, 3], "paged", 3, max_num_batched_tokens=12, **CHUNKED)),
    # Budget 16 after two decodes: prompts of 5 and 6 go whole, the 9-token one takes the 3 left
    # (its chunk ends mid-block) and the rest next step.
    EdgeCase("several prompts share a step; the last takes what is left, ending mid-block",
             SPLIT, partial(simulated, [2, 2, 5, 6, 9], [6, 6, 3, 3, 3], "paged", 5, max_num_batched_tokens=16,
                            arrival_times=[0.0, 0.0, 0.01, 0.01, 0.01], **CHUNKED)),
    EdgeCase("the priority policy asks for one request's chunk at a time (one class)",
             SPLIT, partial(simulated, [5, 30, 4, 3], [8, 3, 3, 2], "paged", 3, max_num_batched_tokens=12,
                            scheduling_policy="priority", **CHUNKED)),
]
