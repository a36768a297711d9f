"""Chapter 2's edges: the token budget binds, decodes included; the head of the queue does not fit."""
from __future__ import annotations

from functools import partial

from . import EdgeCase
from ._engine import simulated

CASES = [
    # Step 1 admits 8 + 8 tokens (budget 16); from step 2 two requests decode, so the 15-token
    # prompt needs 17 of 16 and waits until one of them has finished.
    EdgeCase("the running requests' decodes use up the budget the head needs",
             ("schedule_step",), partial(simulated, [8, 8, 15], [4, 6, 3], "continuous", 3,
                                         max_num_batched_tokens=16)),
    # The head (12) does not fit what is left; a shorter request behind it (2) would, and must wait.
    EdgeCase("the head of the queue does not fit; a shorter one behind it would",
             ("schedule_step",), partial(simulated, [6, 12, 2, 5], [5, 3, 2, 4], "continuous", 4,
                                         max_num_batched_tokens=16)),
    # A prompt of exactly what is left of the budget is admitted; slots bind at B = 2.
    EdgeCase("a prompt that fills the budget exactly; every slot busy",
             ("schedule_step",), partial(simulated, [7, 8, 9, 3, 3], [3, 1, 4, 2, 5], "continuous", 2,
                                         max_num_batched_tokens=16)),
]
