"""Engine checks that reach the edges: a learner's seam against the library's, where it matters.

A chapter's "run it in the engine" cell shows the learner's function serving the real
model on a friendly workload. A wrong function can pass that run: a scheduler that
forgets to charge the decodes to the token budget behaves exactly like the library's
until a budget binds. The cases here drive the engine (the real schedulers and block
manager; the simulator's virtual clock or a tiny random model where a forward is
needed) on workloads built to reach each seam's edges: budgets that bind, prompts that
end on a block edge, a head of the queue that does not fit, preemption. Each case runs
twice, with the library's code and with the learner's plugged in, and what the engine
decided (the step schedule, the blocks, the tokens) must be identical.

One module per chapter, ``minillm/course/edges/<chapter>.py``, lists its ``CASES``.

    from minillm.course import edges
    edges.check("ch02_continuous_batching", {"schedule_step": my_schedule_step})   # [] when identical
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from minillm import seams


@dataclass(frozen=True)
class EdgeCase:
    name: str  # the edge it reaches, e.g. "the head of the queue does not fit the budget"
    seams: tuple[str, ...]  # the seams whose functions it runs
    run: Callable[[], Any]  # runs the engine with whatever is plugged; returns what must match


def cases(chapter: str) -> list[EdgeCase]:
    """The edge cases of ``chapter`` ("ch02_continuous_batching"; "ch02" works too)."""
    from minillm.seams import SEAMS

    full = next((s.chapter for s in SEAMS.values() if s.chapter.startswith(chapter[:4])), chapter)
    try:
        module = importlib.import_module(f"{__name__}.{full}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{full}":
            raise
        return []
    return list(module.CASES)


def _short(value: Any, limit: int = 200) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def difference(got: Any, want: Any, path: str = "") -> str:
    """Where ``got`` first differs from ``want``: a path of keys and indices, then both values there,
    e.g. ``['schedule'][1]: expected (('0', '1'), (1, 1), 4096), got (('0', '1', '2'), (1, 1, 15), 8192)``."""
    if isinstance(got, dict) and isinstance(want, dict) and got != want:
        key = next(k for k in list(want) + list(got) if got.get(k) != want.get(k))
        return difference(got.get(key), want.get(key), f"{path}[{key!r}]")
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)) and got != want:
        i = next((k for k, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if i is None:  # one is a prefix of the other
            n = min(len(got), len(want))
            nxt = want[n] if n < len(want) else got[n]
            return f"{path}: the library's has {len(want)} entries, yours {len(got)} (entry {n}: {_short(nxt)})"
        if isinstance(got[i], (dict, list)) or path.count("[") < 1:
            return difference(got[i], want[i], f"{path}[{i}]")
        return f"{path}[{i}]: expected {_short(want[i])}, got {_short(got[i])}"
    return f"{path}: expected {_short(want)}, got {_short(got)}"


_library: dict[tuple[str, str], Any] = {}  # (chapter, case) -> what the library's code decided


def outcomes(chapter: str, fns: dict[str, Callable], first: bool = False) -> list[tuple[EdgeCase, str]]:
    """Every edge case of ``chapter`` that uses one of ``fns`` (seam name -> function), run with
    the library's code and then with ``fns`` plugged: (case, "" if the engine decided the same,
    else what differed or why it stopped: a broken invariant, a crash). ``first``: stop at the
    first case that differs (the cases are listed cheapest first)."""
    out = []
    for case in cases(chapter):
        used = {n: f for n, f in fns.items() if n in case.seams and f is not None}
        if not used:
            continue
        key = (chapter[:4], case.name)
        if key not in _library:  # deterministic: the library's run is the same every time
            _library[key] = case.run()
        want = _library[key]
        try:
            with seams.plug(**used):
                got = case.run()
        except seams.SeamContractError as e:
            out.append((case, f"the engine stopped: {e}"))
            if first:
                break
            continue
        except NotImplementedError:
            raise
        except Exception as e:  # the learner's function crashed inside the engine
            out.append((case, f"the engine stopped: {type(e).__name__}: {e}"))
            if first:
                break
            continue
        out.append((case, "" if got == want else difference(got, want).lstrip(": ")))
        if first and out[-1][1]:
            break
    return out


def check(chapter: str, fns: dict[str, Callable], first: bool = False) -> list[str]:
    """One line per edge case where ``fns`` plugged in made the engine decide differently from
    the library's code, or stop; an empty list: the engine decided the same in every case.
    ``first``: only the first such case (enough to reject a wrong function)."""
    return [f"{case.name}: {problem}" for case, problem in outcomes(chapter, fns, first) if problem]


def report(chapter: str, fns: dict[str, Callable]) -> list[str]:
    """``check``, printed: how many edge cases ran, then one line per case, what it reaches and
    "same" or what differed."""
    ran = outcomes(chapter, fns)
    if ran:
        bad = sum(1 for _, problem in ran if problem)
        print(f"edge cases: {bad} of {len(ran)} differ from the library's" if bad else
              f"edge cases: the engine decided as with the library's code in all {len(ran)}")
        for case, problem in ran:
            print(f"  - {case.name}: {problem or 'same'}")
    return [f"{case.name}: {problem}" for case, problem in ran if problem]


__all__ = ["EdgeCase", "cases", "check", "difference", "outcomes", "report"]
