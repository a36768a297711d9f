"""An SLO controller: the engine moves its own token budget to keep p95 latencies on target.

    LLM(engine="paged", enable_chunked_prefill=True, max_num_batched_tokens=1024,
        slo={"itl_p95": 0.3, "ttft_p95": 3.0, "window_s": 10})
    python -m minillm serve --enable-chunked-prefill --slo-itl-p95 0.3 --slo-window 10

The knob is the scheduler's token budget (``max_num_batched_tokens``, chapter 4): the
prompt tokens one step may feed next to its decodes. A large budget finishes prompts in
few long steps (first tokens come early, every running stream waits for them); a small
one feeds prompts in short chunks (streams keep their pace, prompts take more steps, and
each step pays the decodes' fixed cost again). So the budget trades time to first token
(TTFT) against the gap between tokens (ITL), and the two targets pull it apart:

* p95 ITL over its target: steps are too long, cut the budget (``floor(budget * decrease)``).
  The AIMD rule of chapter 7, ``slo_token_budget``, through its seam ``next_token_budget``:
  a learner's plugged function makes this decision.
* else p95 TTFT over its target: prompts wait for prefill; give the budget back
  (``ceil(budget / decrease)``, undoing one cut; by ``increase`` tokens only near the
  budget at which the ITL last broke) if the ITL has room (under ``headroom * target``, or
  not measured). A smaller budget would not help here: it slows prefill down (``python -m
  minillm.bench.slo_step`` measures it).
* else every measured p95 under ``headroom * target``: grow by ``increase`` tokens
  (hysteresis: a p95 just under its target keeps the budget).

Always within [min_budget, max_budget] (default: ``max_num_seqs``, one step's decodes, and
the budget the engine started with: to let TTFT take more, give a higher ``max_budget``).
Both p95s over target means the load is more than any budget serves within both targets:
the running streams keep their pace and arrivals wait, the order vLLM's chunked prefill
also takes (decodes first). Past what the largest budget can prefill, no budget lowers
TTFT; only less work does (admission, ``--max-queued-requests``).

The trade is chunked prefill's (``enable_chunked_prefill=True``). Without it a step is all
prefill or all decode and prefills win whenever one can run, so a cut mostly splits the
same prefill work into back-to-back steps that stall the streams about as long; the
continuous engine feeds whole prompts, so its budget never goes below the longest prompt
it accepts.

``SloController`` is fed by the engine after each step (``LLMEngine.step``): the first
tokens and token gaps of the rows that ran, stamped with the engine's clock. Every
``interval_s`` it takes the p95s over the last ``window_s`` seconds and decides; a
decision that changes the budget is an ``SloEvent`` in ``events`` and a log line
(logger ``minillm.slo``), and empties the window: the next decision judges the new budget.
The TTFT window also counts every arrived request still waiting for its first token, at
its age: a queue that grows shows at once, not when its requests are finally served. Off
by default (``EngineConfig.slo=None``).

Plain Python (a leaf): it reads requests and sets one scheduler attribute, and imports
nothing of the engine, so config validation and the tests load no torch.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Iterable

from . import seams

logger = logging.getLogger("minillm.slo")

# The engines whose scheduler spends a token budget per step that the controller can move
# (the simple engine runs one request; a static group is formed once and decoded out).
SLO_ENGINES = ("continuous", "paged")


# -- the rule --------------------------------------------------------------------------------

def slo_token_budget(budget: int, itl_p95: float | None, target: float, *, min_budget: int, max_budget: int,
                     decrease: float = 0.5, increase: int = 16, headroom: float = 0.8) -> int:
    """The next token budget (``max_num_batched_tokens``) of a controller that keeps the p95
    inter-token latency under ``target`` seconds: additive increase, multiplicative decrease.

    * p95 ITL above ``target``: steps are too long, shrink the budget to
      ``floor(budget * decrease)`` (prompt chunks get smaller: decodes wait less);
    * below ``headroom * target``: there is room, grow by ``increase`` tokens (prompts finish
      their prefill in fewer steps: TTFT drops);
    * in between, or no measurement (None): keep it.

    Always clamped to [min_budget, max_budget]. ``min_budget`` must hold one step's decodes
    (``max_num_seqs``); the budget only bounds prompt chunks with chunked prefill on.

    A plugged ``next_token_budget`` (chapter 7) decides instead, once the settings are
    checked here; its answer is checked too (``checked_budget``: an integer within the
    bounds that moves the budget the way the p95 says).
    """
    _positive_int("budget", budget)
    check_budget_settings(target, min_budget, max_budget, decrease, increase, headroom)
    mine = seams.plugged("next_token_budget")  # a learner's version (chapter 7), when plugged in
    if mine is not None:
        got = mine(budget, itl_p95, target, min_budget, max_budget, decrease, increase, headroom)
        return checked_budget(got, budget, itl_p95, target, min_budget, max_budget, headroom)
    if itl_p95 is None:
        nxt = budget
    elif itl_p95 > target:
        nxt = math.floor(budget * decrease)
    elif itl_p95 < headroom * target:
        nxt = budget + increase
    else:
        nxt = budget
    return max(min_budget, min(max_budget, nxt))


def slo_decision(budget: int, ttft_p95: float | None, itl_p95: float | None, config: "SloConfig", *,
                 min_budget: int, max_budget: int, itl_break: int | None = None) -> tuple[int, str]:
    """(next budget, why) for the window's p95 TTFT and ITL (None: not measured), by the rule
    of the module docstring; ``why`` is "" when the budget stays. The ITL's part is
    ``slo_token_budget``'s answer (a plugged ``next_token_budget`` gives it).

    ``itl_break``: the budget at which the ITL last went over its target (None: not yet).
    A TTFT raise doubles the budget only up to ``itl_break - increase``, and goes on from
    there by ``increase`` tokens: without it, the two targets would bounce the budget
    between half and twice what the ITL allows (TCP's slow-start threshold, for the same reason).

    The rule without ``itl_break`` is ``_base_decision`` (chapter 9's exercise, seam
    ``slo_decision``: a plugged function gives the base budget, checked, and ``why`` follows
    from its direction); the ``itl_break`` clamp applies to a raise either way."""
    c = config
    mine = seams.plugged("slo_decision")  # a learner's rule (chapter 9), when plugged in
    if mine is None:
        nxt, why = _base_decision(budget, ttft_p95, itl_p95, c, min_budget, max_budget)
    else:
        got = mine(budget, ttft_p95, itl_p95, c.ttft_p95, c.itl_p95, min_budget=min_budget, max_budget=max_budget,
                   decrease=c.decrease, increase=c.increase, headroom=c.headroom)
        nxt = _checked_decision(got, budget, ttft_p95, itl_p95, c, min_budget, max_budget)
        why = _why(budget, nxt, ttft_p95, itl_p95, c)
    if itl_break is not None and nxt > budget:  # near where the ITL broke last: probe, do not jump
        nxt = max(min_budget, min(max_budget, nxt, max(itl_break - c.increase, budget + c.increase)))
    return nxt, why if nxt != budget else ""


def _base_decision(budget: int, ttft_p95: float | None, itl_p95: float | None, c: "SloConfig", min_budget: int,
                   max_budget: int) -> tuple[int, str]:
    """``slo_decision``'s rule without ``itl_break``: (next budget within the bounds, why)."""
    itl_next = None
    if c.itl_p95 is not None and itl_p95 is not None:
        itl_next = slo_token_budget(budget, itl_p95, c.itl_p95, min_budget=min_budget, max_budget=max_budget,
                                    decrease=c.decrease, increase=c.increase, headroom=c.headroom)
        if itl_p95 > c.itl_p95:
            return itl_next, "itl p95 over target"
    ttft = c.ttft_p95 is not None and ttft_p95 is not None
    nxt, why = budget, ""
    if ttft and ttft_p95 > c.ttft_p95:
        if itl_next is None or itl_next > budget:  # the ITL has room (or is not watched): give budget back
            nxt, why = math.ceil(budget / c.decrease), "ttft p95 over target"
    elif ttft and ttft_p95 >= c.headroom * c.ttft_p95:
        pass  # TTFT within its band: hold (hysteresis)
    elif itl_next is not None:
        nxt, why = itl_next, "under headroom"
    elif ttft:
        nxt, why = budget + c.increase, "under headroom"
    return max(min_budget, min(max_budget, nxt)), why


def _why(budget: int, nxt: int, ttft_p95: float | None, itl_p95: float | None, c: "SloConfig") -> str:
    """The reason of a plugged decision, from its direction and what was over its target."""
    if nxt < budget:
        return "itl p95 over target" if c.itl_p95 is not None and itl_p95 is not None and itl_p95 > c.itl_p95 \
            else "clamped to the bounds"
    if nxt > budget:
        return "ttft p95 over target" if c.ttft_p95 is not None and ttft_p95 is not None and ttft_p95 > c.ttft_p95 \
            else "under headroom"
    return ""


def _checked_decision(got: Any, budget: int, ttft_p95: float | None, itl_p95: float | None, c: "SloConfig",
                      min_budget: int, max_budget: int) -> int:
    """What a plugged ``slo_decision`` returned, as an int; ``seams.SeamContractError`` if the controller cannot
    take it: an integer within the bounds that lowers the budget only for an ITL over its target (the one case
    that cuts), never raises it then, and keeps it when nothing is watched."""
    at = (f"for budget {budget}, p95 TTFT {ttft_p95!r} (target {c.ttft_p95!r}) and p95 ITL {itl_p95!r} "
          f"(target {c.itl_p95!r})")
    nxt = _checked_int("slo_decision", got, at, min_budget, max_budget)
    kept = max(min_budget, min(max_budget, budget))
    itl_over = c.itl_p95 is not None and itl_p95 is not None and itl_p95 > c.itl_p95
    watched = any(t is not None and p is not None for t, p in ((c.ttft_p95, ttft_p95), (c.itl_p95, itl_p95)))
    if itl_over and nxt > kept:
        raise seams.SeamContractError("slo_decision", "a broken ITL must lower the budget (budget * decrease), "
                                      "never raise it", f"{at} it returned {nxt}")
    if not itl_over and nxt < kept:
        raise seams.SeamContractError("slo_decision", "only an ITL over its target lowers the budget",
                                      f"{at} it returned {nxt}, below the budget {kept}")
    if not watched and nxt != kept:
        raise seams.SeamContractError("slo_decision", "with nothing watched the budget stays",
                                      f"{at} it returned {nxt}, not {kept}")
    return nxt


def check_budget_settings(target: float, min_budget: int, max_budget: int, decrease: float = 0.5,
                          increase: int = 16, headroom: float = 0.8) -> None:
    """ValueError unless the rule's settings make sense: bounds ordered, target > 0, ..."""
    for name, v in (("min_budget", min_budget), ("max_budget", max_budget), ("increase", increase)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "increase" else 1):
            raise ValueError(f"{name} must be an integer >= {0 if name == 'increase' else 1}, got {v!r}")
    if min_budget > max_budget:
        raise ValueError(f"min_budget ({min_budget}) must be <= max_budget ({max_budget})")
    if isinstance(target, bool) or not (isinstance(target, (int, float)) and target > 0):
        raise ValueError(f"target must be a number of seconds > 0, got {target!r}")
    if not 0 < decrease < 1 or not 0 < headroom <= 1:
        raise ValueError(f"decrease must be in (0, 1) and headroom in (0, 1], got {decrease!r}, {headroom!r}")


def checked_budget(got: Any, budget: int, itl_p95: float | None, target: float, min_budget: int,
                   max_budget: int, headroom: float = 0.8) -> int:
    """What a plugged ``next_token_budget`` returned, as an int; ``seams.SeamContractError`` if the engine cannot
    take it: an integer within the bounds, moving the way the p95 ITL says (never up while it is over the
    target, never down while it is under ``headroom * target``, the budget kept in between or without a
    measurement; the clamp to the bounds aside)."""
    at = f"for budget {budget} and p95 ITL {itl_p95!r} (target {target!r} s, headroom {headroom!r})"
    nxt = _checked_int("next_token_budget", got, at, min_budget, max_budget)
    kept = max(min_budget, min(max_budget, budget))

    def broken(invariant: str) -> seams.SeamContractError:
        return seams.SeamContractError("next_token_budget", invariant, f"{at} it returned {nxt}")

    if itl_p95 is not None and itl_p95 > target:
        if nxt > kept:
            raise broken("a broken ITL must lower the budget (budget * decrease), never raise it")
    elif itl_p95 is not None and itl_p95 < headroom * target:
        if nxt < kept:
            raise broken("a p95 ITL under headroom x target never lowers the budget (budget + increase)")
    elif nxt != kept:
        raise broken("a p95 ITL between headroom x target and the target, or no measurement, keeps the budget")
    return nxt


def _checked_int(seam: str, got: Any, at: str, min_budget: int, max_budget: int) -> int:
    """``got`` as an int within [min_budget, max_budget], else ``seams.SeamContractError`` naming ``seam``."""
    if isinstance(got, bool) or not isinstance(got, numbers.Integral):
        raise seams.SeamContractError(seam, "return the next budget as an int (math.floor a product)",
                                      f"{at} it returned {got!r}")
    if not min_budget <= got <= max_budget:
        raise seams.SeamContractError(seam, "clamp the result to the bounds",
                                      f"{at} it returned {got}, outside [min_budget, max_budget] = "
                                      f"[{min_budget}, {max_budget}]")
    return int(got)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def p95(values: Iterable[float]) -> float | None:
    """The 95th percentile, linearly interpolated (``bench.summary.percentiles``' definition); None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * 0.95
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# -- the configuration -----------------------------------------------------------------------

@dataclass(slots=True)
class SloConfig:
    """The targets and the controller's settings (``EngineConfig.slo``, as a dict).

    At least one target: ``ttft_p95`` and/or ``itl_p95`` (seconds). ``window_s``: the
    seconds of recent first tokens and token gaps a decision looks at (required: there is
    no good default, it depends on the traffic: a window should hold tens of requests);
    ``interval_s``: seconds between decisions (None: ``window_s / 2``). ``min_budget`` and
    ``max_budget`` bound the budget (None: ``max_num_seqs`` and the engine's starting
    ``max_num_batched_tokens``). ``decrease``, ``increase`` and ``headroom``: the rule's
    (module docstring).
    """

    ttft_p95: float | None = None
    itl_p95: float | None = None
    window_s: float | None = None
    interval_s: float | None = None
    min_budget: int | None = None
    max_budget: int | None = None
    decrease: float = 0.5
    increase: int = 16
    headroom: float = 0.8

    def __post_init__(self) -> None:
        if self.ttft_p95 is None and self.itl_p95 is None:
            raise ValueError("slo needs a target: give ttft_p95 and/or itl_p95 (seconds), e.g. "
                             "{'itl_p95': 0.3, 'window_s': 10}")
        for name in ("ttft_p95", "itl_p95"):
            _check_seconds(f"slo {name}", getattr(self, name), "a p95 latency target in seconds")
        if self.window_s is None:
            raise ValueError("slo needs window_s: the seconds of recent tokens each decision looks at, "
                             "e.g. {'window_s': 10} (long enough to hold tens of requests)")
        _check_seconds("slo window_s", self.window_s, "the seconds of recent tokens each decision looks at")
        if self.interval_s is None:
            self.interval_s = self.window_s / 2
        _check_seconds("slo interval_s", self.interval_s, "seconds between decisions (default window_s / 2)")
        for name in ("min_budget", "max_budget"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(f"slo {name}", value)
        if self.min_budget is not None and self.max_budget is not None and self.min_budget > self.max_budget:
            raise ValueError(f"slo min_budget ({self.min_budget}) must be <= max_budget ({self.max_budget})")
        d, h = self.decrease, self.headroom
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < 1:
            raise ValueError(f"slo decrease must be a factor in (0, 1) (0.5 halves the budget), got {d!r}")
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 < h <= 1:
            raise ValueError(f"slo headroom must be in (0, 1]: the budget grows only while every p95 is under "
                             f"headroom x its target (0.8), got {h!r}")
        if isinstance(self.increase, bool) or not isinstance(self.increase, int) or self.increase < 0:
            raise ValueError(f"slo increase must be an integer >= 0 (tokens added per decision), "
                             f"got {self.increase!r}")

    @classmethod
    def from_dict(cls, options: "dict | SloConfig") -> "SloConfig":
        if isinstance(options, SloConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"slo must be a dict such as {{'itl_p95': 0.3, 'ttft_p95': 3.0, 'window_s': 10}}, "
                             f"got {options!r}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown slo option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
        return cls(**options)


def _check_seconds(name: str, value: Any, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a number of seconds > 0 ({what}), got {value!r}")


def check_slo_engine(config: SloConfig, engine: str, max_num_seqs: int) -> None:
    """ValueError if ``engine`` has no token budget to move, or the bounds cannot hold its decodes."""
    if engine not in SLO_ENGINES:
        raise ValueError(f"slo moves the token budget of a continuous or paged engine; the {engine!r} engine "
                         f"has none that changes its latency (simple: one request at a time; static: a group "
                         f"decodes out as one): pass engine='paged' (or 'continuous'), or leave slo=None")
    if config.min_budget is not None and config.min_budget < max_num_seqs:
        raise ValueError(f"slo min_budget={config.min_budget} is smaller than max_num_seqs={max_num_seqs}: a "
                         f"step gives each running request one decode token. Raise min_budget to at least "
                         f"{max_num_seqs}")


# -- the controller ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SloEvent:
    """A decision that changed the budget."""

    time: float  # the engine's clock
    ttft_p95: float | None  # the window's p95s the decision saw (None: not measured)
    itl_p95: float | None
    old_budget: int
    new_budget: int
    reason: str

    @property
    def direction(self) -> str:
        return "down" if self.new_budget < self.old_budget else "up"


@dataclass(frozen=True, slots=True)
class SloSnapshot:
    """The controller's state as plain numbers (``EngineSnapshot.slo``; the server's /metrics)."""

    token_budget: int
    ttft_target: float | None
    itl_target: float | None
    ttft_p95: float | None  # at the latest decision
    itl_p95: float | None
    num_decisions: int
    num_decreases: int
    num_increases: int
    last_event_time: float | None


class SloController:
    """Keeps the window, decides every ``interval_s``, sets ``scheduler.max_num_batched_tokens``.

    ``start_budget`` is the budget the engine was built with; ``max_model_len`` the longest
    sequence (the continuous engine feeds whole prompts: its budget never goes below the
    longest prompt it accepts, or that prompt would wait for ever).
    """

    def __init__(self, config: SloConfig | dict, scheduler: Any, engine: str = "paged",
                 max_model_len: int | None = None):
        self.config = c = SloConfig.from_dict(config)
        self.scheduler = scheduler
        seqs, start = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
        check_slo_engine(c, engine, seqs)
        self.max_budget = start if c.max_budget is None else c.max_budget
        floor = seqs
        if engine == "continuous":
            longest = self.max_budget if max_model_len is None else min(self.max_budget, max_model_len - 1)
            if c.min_budget is not None and c.min_budget < longest:
                raise ValueError(f"slo min_budget={c.min_budget} is below {longest}, the longest prompt the "
                                 f"continuous engine accepts: it feeds whole prompts, so such a prompt would never "
                                 f"be admitted. Give min_budget >= {longest}, or use engine='paged' (which chunks "
                                 f"a prompt longer than the budget)")
            floor = max(seqs, longest)
        self.min_budget = floor if c.min_budget is None else c.min_budget
        if not self.min_budget <= start <= self.max_budget:
            raise ValueError(f"the engine starts with max_num_batched_tokens={start}, outside the slo bounds "
                             f"[min_budget, max_budget] = [{self.min_budget}, {self.max_budget}]: start within "
                             f"them, or widen them")
        self._ttft: deque[tuple[float, float]] = deque()  # (time, seconds): first tokens in the window
        self._itl: deque[tuple[float, float]] = deque()  # (time, seconds): token gaps in the window
        self._seen: dict[int, tuple[Any, int]] = {}  # id(request) -> (request, token times read)
        self._next_decision: float | None = None
        self.events: list[SloEvent] = []
        self.num_decisions = self.num_decreases = self.num_increases = 0
        self.last_ttft_p95: float | None = None
        self.last_itl_p95: float | None = None
        self.itl_break: int | None = None  # the budget at which the ITL last went over its target

    # -- what the engine calls ------------------------------------------------------------
    def after_step(self, requests: Iterable[Any], now: float) -> SloEvent | None:
        """Read the new tokens of ``requests`` (the rows of the step that just ended at ``now``);
        decide if ``interval_s`` has passed since the last decision. The event, if the budget moved."""
        self.observe(requests)
        if self._next_decision is None:
            self._next_decision = now + self.config.interval_s
        if now < self._next_decision:
            return None
        self._next_decision = now + self.config.interval_s
        return self.decide(now)

    def observe(self, requests: Iterable[Any]) -> None:
        """Take the first tokens and token gaps of ``requests`` not read yet into the window."""
        for r in requests:
            m = r.metrics
            key = id(r)
            _, n_seen = self._seen.get(key, (r, 0))
            times = m.token_times
            n = len(times)
            if n_seen == 0 and n and m.first_token_time is not None:
                self._ttft.append((m.first_token_time, m.first_token_time - m.arrival_time))
            for i in range(max(n_seen, 1), n):
                self._itl.append((times[i], times[i] - times[i - 1]))
            if r.is_finished:
                self._seen.pop(key, None)
            else:
                self._seen[key] = (r, n)

    def window_p95(self, now: float) -> tuple[float | None, float | None]:
        """(p95 TTFT, p95 ITL) over the last ``window_s`` seconds. TTFT includes, at their age,
        the arrived requests still waiting for their first token."""
        since = now - self.config.window_s
        for q in (self._ttft, self._itl):
            while q and q[0][0] < since:
                q.popleft()
        for key, (r, _) in list(self._seen.items()):  # aborted elsewhere: nothing more will come
            if r.is_finished:
                del self._seen[key]
        ttft = [v for _, v in self._ttft]
        s = self.scheduler
        for r in (*s.waiting, *s.running):
            if r.metrics.first_token_time is None and r.arrival_time <= now:
                ttft.append(now - r.arrival_time)
        return p95(ttft), p95(v for _, v in self._itl)

    def decide(self, now: float) -> SloEvent | None:
        """One decision now: set the budget the rule gives. The event if it changed."""
        ttft, itl = self.window_p95(now)
        self.last_ttft_p95, self.last_itl_p95 = ttft, itl
        self.num_decisions += 1
        old = self.scheduler.max_num_batched_tokens
        c = self.config
        new, reason = slo_decision(old, ttft if c.ttft_p95 is not None else None,
                                   itl if c.itl_p95 is not None else None, c,
                                   min_budget=self.min_budget, max_budget=self.max_budget, itl_break=self.itl_break)
        if c.itl_p95 is not None and itl is not None:
            if itl > c.itl_p95:
                self.itl_break = old
            elif self.itl_break is not None and itl < c.headroom * c.itl_p95 and old >= self.itl_break:
                self.itl_break = None  # the load has changed: the ITL holds where it broke before
        if new == old:
            return None
        self.scheduler.max_num_batched_tokens = new
        # The next decision judges the new budget: tokens timed under the old one leave the window
        # (else one slow window would cut twice). Waiting requests still count, at their age.
        self._ttft.clear()
        self._itl.clear()
        event = SloEvent(now, ttft, itl, old, new, reason)
        self.events.append(event)
        if new < old:
            self.num_decreases += 1
        else:
            self.num_increases += 1
        logger.info("token budget %d -> %d: %s (window p95 TTFT %s, ITL %s)", old, new, reason,
                    _ms(ttft), _ms(itl))
        return event

    @property
    def token_budget(self) -> int:
        return self.scheduler.max_num_batched_tokens

    def snapshot(self) -> SloSnapshot:
        events = self.events
        return SloSnapshot(self.scheduler.max_num_batched_tokens, self.config.ttft_p95, self.config.itl_p95,
                           self.last_ttft_p95, self.last_itl_p95, self.num_decisions, self.num_decreases,
                           self.num_increases, events[-1].time if events else None)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


__all__ = ["SloConfig", "SloController", "SloEvent", "SloSnapshot", "slo_token_budget", "slo_decision",
           "check_budget_settings", "checked_budget", "check_slo_engine", "p95", "SLO_ENGINES"]
