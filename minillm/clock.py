"""The engine's clock: wall time when serving, a virtual clock when simulating.

The engine reads time only through one of these, so the same step loop serves a real
model (``WallClock``) and the cost-model simulator behind the chapters' widgets
(``VirtualClock``: a step takes as long as the cost model says, and waiting for the
next arrival is a jump, not a sleep).
"""
from __future__ import annotations

import time


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        """Nothing to run before ``t``: sleep a little (new requests may come meanwhile)."""
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(min(delay, 0.05))


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def wait_until(self, t: float) -> None:
        if t <= self.t:
            raise RuntimeError("the scheduler scheduled nothing although the next waiting request has arrived")
        self.t = t


__all__ = ["WallClock", "VirtualClock"]
