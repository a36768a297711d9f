"""Chapter 9's edges: the host tier's idle copies on the paged engine, the two-target SLO
controller on recorded windows, and the A/B table on fixed samples.

* ``blocks_to_offload``: the paged engine with prefix caching and a host tier on the
  simulator's virtual clock (``edges.ch06_prefix_and_priority.paged_run``), one request at a
  time, so the pool holds blocks the host already copied ahead of blocks it has not. With
  ``idle_s = 0`` a block freed at the end of a step is exactly ``idle_s`` old when the next
  step starts; with ``idle_s = 0.1`` fresh blocks sit behind idle ones. What must match:
  each step's copies to and from the host, its hits, and the block tables.
* ``slo_decision``: the engine's SLO controller (``slo.SloController.decide``, with its
  ``itl_break`` memory) replayed on recorded windows of (p95 TTFT, p95 ITL) that visit every
  case of the rule, with ``decrease`` 0.7 so a give-back is not a doubling.
* ``bootstrap_ci``: ``bench.ab.compare`` of two fixed sets of load records. A correct
  bootstrap need not draw what the library draws, so what must match is what every correct
  one gives on these samples: each row's difference exactly and its verdict (the samples are
  built so that each verdict stands well clear of the interval's random edges), and numpy's
  global generator left alone.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from . import EdgeCase
from .ch06_prefix_and_priority import paged_run
from .ch07_serving_online import replay_controller

# -- the host tier ------------------------------------------------------------------------------

BS = 4
A = list(range(3, 12))  # 9 tokens: two full blocks and a partial one
B = list(range(20, 29))
C = list(range(40, 53))  # 13 tokens: three full blocks
HOST = dict(block_size=BS, enable_prefix_caching=True)
# Three prompts, then each comes back: the pool holds A's blocks (copied to the host as soon as
# A finished) ahead of B's, and the returning prompts hit what is left on either tier.
RETURNS = ([A, B, C, A + [1], B + [2], C + [3]], [2, 2, 2, 2, 2, 2])
# More prompts than the device holds, freed at different times: with idle_s 0.1 (three or so
# steps) fresh blocks sit behind idle ones, and evicted blocks come back from the host.
CROWD = ([A, B, C, [60 + i for i in range(17)], A + [4], C + [5], B + [6], [80 + i for i in range(9)], A + [7]],
         [3, 2, 4, 2, 3, 2, 2, 5, 2])

# -- the SLO controller -------------------------------------------------------------------------

# Targets whose bands are exact in binary: TTFT [1.5, 2.0], ITL [0.1875, 0.25] (headroom 0.75).
BOTH = dict(ttft_p95=2.0, itl_p95=0.25, window_s=1.0, min_budget=16, max_budget=400, decrease=0.7, increase=8,
            headroom=0.75)
BOTH_WINDOWS = [
    (3.0, 0.1),  # case 2, the ITL has room: give back ceil(100 / 0.7) = 143
    (3.0, 0.2),  # case 2, the ITL in its band: no room, hold
    (1.8, 0.1),  # case 3: the TTFT in its band holds, though the ITL has room
    (1.5, 0.1),  # case 3 at the band's lower edge
    (1.0, 0.1),  # case 4: grow by increase
    (None, None),  # nothing measured: hold
    (1.0, None),  # case 5: only the TTFT measured, under headroom: grow
    (3.0, None),  # case 2 without an ITL measurement: give back
    (3.0, 0.3),  # case 1: the ITL over its target cuts, whatever the TTFT
    (1.0, 0.25),  # the ITL exactly at its target: not over
    *[(1.0, 0.3)] * 7,  # cuts down to min_budget, and one past it
    (2.5, 0.05),  # after a cut: a give-back stops short of the budget the ITL broke at
]

# -- the A/B table ------------------------------------------------------------------------------


def _load_result(ttfts, tpots, e2es, label):
    from minillm.bench.loadgen import LoadResult

    records = [{"index": i, "arrival": 0.1 * i, "lag": 0.0, "ttft": t, "tpot": p, "e2e": e, "itls": [p] * 3,
                "output_tokens": 4, "ok": True, "status": 200} for i, (t, p, e) in enumerate(zip(ttfts, tpots, e2es))]
    return LoadResult("http://unused", None, records, 0.1 * len(records) + max(e2es), 1.0, 0.2, label=label)


def ab_samples(n: int = 60) -> tuple[Any, Any]:
    """A and B: B's TTFTs clearly slower (worse at every percentile), its TPOTs drawn from A's
    distribution (no difference), its E2Es faster by 0.2 s (one standard deviation): the 95%
    interval of the E2E p95 stays below 0 (its upper end between -0.11 and -0.06 over 200
    seeds) while the largest resampled differences reach past it (0.10 to 0.25)."""
    rng = np.random.default_rng(2024)
    ttft_a, ttft_b = rng.lognormal(-1.0, 0.3, n), rng.lognormal(-1.0, 0.3, n) * 2.0
    tpot_a, tpot_b = rng.lognormal(-3.0, 0.2, n), rng.lognormal(-3.0, 0.2, n)
    e2e_a = rng.normal(2.0, 0.2, n)
    e2e_b = e2e_a - 0.2 + rng.normal(0.0, 0.02, n)
    return (_load_result(ttft_a.tolist(), tpot_a.tolist(), e2e_a.tolist(), "A"),
            _load_result(ttft_b.tolist(), tpot_b.tolist(), e2e_b.tolist(), "B"))


def ab_table() -> dict[str, Any]:
    """Each bootstrapped row of ``ab.compare``: (metric, B - A, verdict); and numpy's global state."""
    from minillm.bench import ab

    a, b = ab_samples()
    state = np.random.get_state()
    rows = ab.compare(a, b, n_boot=2000)
    after = np.random.get_state()
    untouched = all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(state, after))
    return {"rows": [(r.metric, None if r.diff is None else round(r.diff, 9), r.verdict) for r in rows
                     if r.ci_low is not None],
            "numpy's global generator left alone": untouched}


CASES = [
    EdgeCase("idle_s 0: a block freed at a step's end is idle at the next; copied blocks lead the pool",
             ("blocks_to_offload",),
             partial(paged_run, *RETURNS, num_blocks=10, kv_offload={"host_blocks": 16, "idle_s": 0.0}, **HOST)),
    EdgeCase("idle_s 0.1: fresh blocks behind idle ones, evictions restored from the host",
             ("blocks_to_offload",),
             partial(paged_run, *CROWD, num_blocks=9, kv_offload={"host_blocks": 12, "idle_s": 0.1}, **HOST)),
    EdgeCase("the SLO controller on windows that visit every case, the band edges and the floor",
             ("slo_decision",), lambda: replay_controller(BOTH, BOTH_WINDOWS, 100)),
    EdgeCase("the A/B table: a clear slowdown, no difference, a small speed-up",
             ("bootstrap_ci",), ab_table),
]
