"""CPU threads for a machine that other programs share.

torch runs each CPU op on a team of OpenMP threads that meet at a barrier after the op.
A team member that is waiting spins for a while before it sleeps, which is what makes a
team fast on an idle machine (a sleeping thread takes tens of microseconds to wake, and a
decode step runs over a thousand ops). On a machine where another program is busy, a
team as large as the core count is a trap: the OS parks one member to run the other
program, and the rest of the team spins at every barrier until it comes back. A step
then takes ten times as long, or more.

``ThreadGovernor`` avoids the trap without giving up the idle-machine speed: between
engine steps (at most every ``interval`` seconds) it reads how much CPU the *other*
programs used since the last look (``/proc/stat`` minus this process's own time) and
sets torch's thread count to the cores they leave free, never more than torch's own
default. With the machine to itself the engine keeps the full team; with one busy
program on a 2-core machine it runs one thread, which is never parked at a barrier.
Where ``/proc/stat`` does not exist (macOS, Windows) it does nothing.

``LLM(cpu_threads=...)``: ``"auto"`` (the default on the CPU) is the governor; an
integer fixes the count; ``None`` leaves torch's setting alone.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# The team size a governor may go back up to: torch's count when the first governor started,
# unless the user has set a count since (then theirs). ``_set_by_governor`` tells the two apart.
_ceiling: int | None = None
_set_by_governor: int | None = None


def ceiling() -> int:
    """Most threads a governor uses: the user's (or torch's default) count, not a governor's own."""
    global _ceiling
    now = torch.get_num_threads()
    if _ceiling is None or now != _set_by_governor:
        _ceiling = now
    return _ceiling


def _busy_ticks() -> int | None:
    """CPU ticks all programs spent working (not idle, not waiting on I/O) since boot."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)


def _own_ticks() -> int:
    t = os.times()
    return round((t.user + t.system) * _TICK)


def cpu_count() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadGovernor:
    """Sets torch's CPU thread count to the cores other programs leave free.

    ``tick()`` is cheap (one clock read) unless ``interval`` seconds have passed; then it
    reads two counters and may call ``torch.set_num_threads``. The decision uses the
    other programs' average load over the last window, smoothed so one short burst does
    not flip the team size back and forth.
    """

    def __init__(self, max_threads: int | None = None, interval: float = 0.5, smoothing: float = 0.5):
        self.max_threads = max_threads or ceiling()
        self.cores = cpu_count()
        self.interval = interval
        self.smoothing = smoothing
        self.others = 0.0  # smoothed cores used by other programs
        self.changes = 0  # how often the thread count changed (reported by bench)
        self.enabled = _busy_ticks() is not None
        self._last = self._sample() if self.enabled else None

    def _sample(self) -> tuple[float, int, int]:
        return time.monotonic(), _busy_ticks() or 0, _own_ticks()

    def threads_for(self, others: float) -> int:
        """Thread count when other programs keep ``others`` cores busy."""
        free = self.cores - others
        return max(1, min(self.max_threads, int(free + 0.5)))

    def tick(self) -> int:
        """Look again if the interval has passed; return the thread count in use."""
        if not self.enabled:
            return torch.get_num_threads()
        now = time.monotonic()
        t0, busy0, own0 = self._last
        if now - t0 < self.interval:
            return torch.get_num_threads()
        t, busy, own = self._sample()
        self._last = (t, busy, own)
        window = (t - t0) * _TICK
        others = max(0.0, ((busy - busy0) - (own - own0)) / window) if window > 0 else 0.0
        self.others = self.smoothing * self.others + (1 - self.smoothing) * others
        n = self.threads_for(self.others)
        if n != torch.get_num_threads():
            global _set_by_governor
            torch.set_num_threads(n)
            _set_by_governor = n
            self.changes += 1
        return n


@contextlib.contextmanager
def keeps_torch_threads():
    """Torch's thread count afterwards is the one before: ``with keeps_torch_threads():``,
    or ``@keeps_torch_threads()`` on a command's ``main``.

    ``--threads`` (and a governor) set torch's count for the whole process; a command run
    in a notebook or a test (``bench.main([...])``) must not leave the rest of that process
    on its setting."""
    n = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


def make_governor(cpu_threads, device: torch.device) -> ThreadGovernor | None:
    """The engine's thread policy from ``LLM(cpu_threads=...)``; None where it fixes nothing per step."""
    if device.type != "cpu" or cpu_threads is None:
        return None
    if cpu_threads == "auto":
        gov = ThreadGovernor()
        return gov if gov.enabled else None
    torch.set_num_threads(int(cpu_threads))
    return None
