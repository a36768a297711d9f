"""Priority classes with queue timeouts: who is admitted next, and who makes room.

Plain functions on requests (no tensors), used by ``PagedScheduler`` when
``scheduling_policy="priority"`` (chapter 6). A request's level is
``request.priority`` (``SamplingParams.priority``: interactive 0, standard 1, batch 2,
or any integer; lower is served first). Each class has a queue timeout (engine-level,
``EngineConfig.queue_timeouts``; defaults 50 ms / 200 ms / 1 s).

Admission order, among the waiting requests that have arrived:

1. the requests that have waited past their class's timeout go first;
2. then the others;

and within each group the highest class (lowest level) first, then queue order (first
come, first served, a preempted request back at the front). So a fresh interactive
request overtakes every batch job still within its timeout, and a batch job that has
waited past its timeout overtakes fresh arrivals (until they time out too: 50 ms for
interactive, by default). Nobody starves.

If the request picked cannot start for lack of KV blocks or a batch slot and it has
timed out, the lowest-class running request (the newest among equals) is preempted to
make room, but only one of a strictly lower class: preempting an equal would swap two
requests and help nobody. A request that has not timed out waits for room: nobody
behind it jumps the queue.

With every request in one class and no timeouts this is first come, first served.

The admission order is a seam (``minillm/seams.py``): chapter 6's ``admission_order``
exercise, on (request id, level, arrival time) tuples, can take the library's place.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .. import seams
from ..request import Request


def is_timed_out(request: Request, now: float, timeout_of: Callable[[int], float]) -> bool:
    """Has ``request`` waited in the queue (since its arrival) longer than its class's timeout?"""
    return now - request.arrival_time > timeout_of(request.priority)


def admission_key(request: Request, position: int, now: float, timeout_of: Callable[[int], float]) -> tuple:
    """Sort key of a waiting request at queue ``position``: (not timed out, level, position)."""
    return (0 if is_timed_out(request, now, timeout_of) else 1, request.priority, position)


def admission_order(waiting: Sequence[Request], now: float, timeout_of: Callable[[int], float]) -> list[Request]:
    """The arrived waiting requests in the order the priority scheduler admits them."""
    mine = seams.plugged("admission_order")  # a learner's order (chapter 6), when plugged in
    if mine is not None:
        return _plugged_admission_order(mine, waiting, now, timeout_of)
    arrived = [(i, r) for i, r in enumerate(waiting) if r.arrival_time <= now]
    return [r for i, r in sorted(arrived, key=lambda ir: admission_key(ir[1], ir[0], now, timeout_of))]


def _plugged_admission_order(mine: Callable, waiting: Sequence[Request], now: float,
                             timeout_of: Callable[[int], float]) -> list[Request]:
    """``admission_order`` through a plugged ``admission_order(waiting, now, timeouts)`` on plain values.

    The function gets (request id, priority level, arrival time) per waiting request, in
    queue order, and a dict level -> queue timeout (the three classes and every level
    waiting); it returns request ids. The answer must name every arrived waiting request
    once and nobody else, or it is a ``seams.SeamContractError`` (the scheduler then
    changes nothing).
    """
    by_id = {r.request_id: r for r in waiting}
    if len(by_id) != len(waiting):
        raise ValueError("admission_order (exercises/ch06_prefix_and_priority.py) needs distinct request ids, "
                         "and two waiting requests share one")
    tuples = [(r.request_id, r.priority, r.arrival_time) for r in waiting]
    timeouts = {level: timeout_of(level) for level in sorted({0, 1, 2} | {r.priority for r in waiting})}
    got = mine(tuples, now, timeouts)

    def broken(invariant: str, what: str) -> seams.SeamContractError:
        return seams.SeamContractError("admission_order", invariant, what)

    try:
        ids = list(got)
    except TypeError:
        raise broken("it must return a list of request ids", f"got {_short(got)}") from None
    order, seen = [], set()
    for rid in ids:
        try:
            r = by_id.get(rid)
        except TypeError:  # an unhashable id
            r = None
        if r is None:
            raise broken("every id names a waiting request",
                         f"returned {rid!r}, which is not a waiting request; waiting: {_short([t[0] for t in tuples])}")
        if rid in seen:
            raise broken("every waiting request is named at most once", f"returned {rid!r} twice: {_short(ids)}")
        if r.arrival_time > now:
            raise broken("requests that have not arrived are left out",
                         f"returned {rid!r}, which has not arrived yet (arrival {r.arrival_time:.6g} > now {now:.6g})")
        seen.add(rid)
        order.append(r)
    if len(order) < sum(1 for r in waiting if r.arrival_time <= now):
        missing = [r.request_id for r in waiting if r.arrival_time <= now and r.request_id not in seen]
        raise broken("every arrived waiting request is in the order",
                     f"left out {_short(missing)}, which have arrived; got {_short(ids)}")
    return order


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...]"


def pick_victim(running: Sequence[Request], below_level: int | None = None,
                exclude: Sequence[Request] = ()) -> Request | None:
    """The running request to preempt: the lowest class, the newest (latest admitted) among equals.

    ``running`` is in admission order. ``exclude``: requests that must keep their blocks
    (they have a row this step). ``below_level``: only a request of a strictly lower class
    (a greater level) qualifies. None when nobody qualifies.
    """
    skip = {id(r) for r in exclude}
    best, best_key = None, None
    for i, r in enumerate(running):
        if id(r) in skip or (below_level is not None and r.priority <= below_level):
            continue
        key = (r.priority, i)
        if best_key is None or key > best_key:
            best, best_key = r, key
    return best


__all__ = ["is_timed_out", "admission_key", "admission_order", "pick_victim"]
