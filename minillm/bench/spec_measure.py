"""Measuring speculation honestly: wall time, tokens, counters, and the cost of verifying.

* ``timed_run``: one batch of prompts through an engine, timed, with the speculation
  counters of that run only.
* ``forward_cost``: how long one target forward takes when a request feeds 1 + k tokens,
  relative to a plain one-token decode -- the ``verify_cost`` of
  ``policy.expected_speedup``. It is ~1 when decode is bound by reading the weights (a
  GPU at small batch) and grows with k when the device is compute-bound (a CPU).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from minillm import placement
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from minillm.scheduler.output import ScheduledRequest, SchedulerOutput


def timed_run(engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> dict[str, Any]:
    """Run ``prompts`` together (as one offline batch) and time it.

    Returns wall_s, output_tokens, tokens_per_s, token_ids (per prompt), target_forwards
    and, for a speculative engine, the counters of this run (``SpecStats.as_dict``).
    """
    if engine.speculator is not None:
        engine.speculator.reset_stats()
    steps_before = len(engine.step_records)
    requests = [engine.make_request(list(p), params) for p in prompts]
    placement.synchronize(engine.device)
    start = time.perf_counter()
    outs = engine.run(requests)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    result = dict(wall_s=wall, output_tokens=tokens, tokens_per_s=tokens / wall,
                  token_ids=[o.token_ids for o in outs], target_forwards=len(engine.step_records) - steps_before)
    if engine.speculator is not None:
        result.update(engine.speculator.stats.as_dict())
    return result


@torch.inference_mode()
def forward_cost(runner, num_tokens: Sequence[int], context: int = 128, batch: int = 1,
                 repeats: int = 3) -> dict[int, float]:
    """Seconds of one forward in which each of ``batch`` requests verifies n - 1 drafts (feeds
    n tokens after ``context`` cached ones, logits at all n), for each n in ``num_tokens``
    (median of ``repeats``). n = 1 is a plain decode step."""
    bs = runner.block_size
    blocks = -(-(context + max(num_tokens)) // bs)
    if blocks * batch > runner.kv_caches[0][0].shape[0]:
        raise ValueError("the KV cache is too small for this measurement: lower context or batch")
    out = {}
    for n in num_tokens:
        rows = []
        for b in range(batch):
            # a decoding request verifying n - 1 drafts: n query tokens, n logits rows
            r = Request(f"cost{b}", [100 + (i % 1000) for i in range(context + 1)], SamplingParams())
            r.block_ids = list(range(b * blocks, (b + 1) * blocks))
            r.num_computed_tokens = context
            rows.append(ScheduledRequest(r, 1, spec_token_ids=[7] * (n - 1)))
        step = SchedulerOutput(rows)
        runner.execute(step)  # warm-up
        times = []
        for _ in range(repeats):
            placement.synchronize(runner.device)
            t = time.perf_counter()
            runner.execute(step)
            placement.synchronize(runner.device)
            times.append(time.perf_counter() - t)
        out[n] = sorted(times)[len(times) // 2]
    return out


__all__ = ["timed_run", "forward_cost"]
