"""Chapter 1's edges: a group is closed until its longest member ends; the token budget caps a group."""
from __future__ import annotations

from functools import partial

from . import EdgeCase
from ._engine import simulated

CASES = [
    # B = 3: the first group is (2, 9, 4) outputs; members 0 and 2 finish long before member 1,
    # and their idle slots must stay empty while 3 and 4 wait.
    EdgeCase("members finish early; their slots stay idle until the longest member ends",
             ("static_schedule",), partial(simulated, [4, 6, 5, 3, 2], [2, 9, 4, 3, 5], "static", 3,
                                           max_num_batched_tokens=64)),
    # Budget 16: 6 + 10 fills it exactly (the group is (6, 10)); then the head (12) does not fit
    # beside 5, and the 3 behind it would: the group is (5) alone, then (12, 3), then (9).
    EdgeCase("a prompt fills the budget exactly; the head does not fit, a shorter one behind it would",
             ("static_schedule",), partial(simulated, [6, 10, 5, 12, 3, 9], [3, 2, 4, 2, 3, 1], "static", 4,
                                           max_num_batched_tokens=16)),
    # Requests arrive while a group runs: the next group forms from those that have arrived,
    # only once the running group is done.
    EdgeCase("requests arrive while a group runs; one-token outputs end a group at its prefill",
             ("static_schedule",), partial(simulated, [3, 5, 2, 4, 6], [1, 4, 1, 2, 1], "static", 2,
                                           arrival_times=[0.0, 0.0, 0.05, 0.05, 0.3],
                                           max_num_batched_tokens=32)),
]
