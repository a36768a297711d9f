"""SamplingParams: how one request samples and when it stops, validated at construction.

Plain Python (no torch): the request, the scheduler and the server's request parsing hold
one without importing the sampler (``sampling.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import SEED_LIMIT, check_bool_fields, check_seed, priority_class, priority_level

_EPS_TEMPERATURE = 1e-5  # below this a temperature is treated as greedy


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops; every field is checked here, so a bad
    value fails at construction with the field's name, not steps later in the sampler.

    ``stop``: strings that end the output when they appear in its text; ``stop_token_ids``:
    tokens that end it (besides EOS, unless ``ignore_eos``). ``include_stop_str_in_output``
    (vLLM's option): whether the stop string that ended the output, or the text of the
    stop token, stays at the end of the output text (default: cut off).
    ``seed``: an integer in [0, 2**64), the range of ``torch.Generator.manual_seed``
    (negative seeds are rejected: torch reads -1 as 2**64 - 1, so two seeds would alias).
    ``priority``: the request's class, "interactive", "standard" (default) or "batch", or
    an integer level (lower is served first; 0, 1, 2 are those classes). Only the
    ``scheduling_policy="priority"`` engine orders by it; every engine reports per class.
    """

    temperature: float = 1.0
    top_k: int = -1  # -1: no top-k
    top_p: float = 1.0  # 1.0: no nucleus cut
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (not part of the output text by default)
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    priority: str | int = "standard"

    def __post_init__(self) -> None:
        check_bool_fields(self)
        priority_level(self.priority)  # ValueError naming the valid classes
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        self.temperature = float(t)
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        self.top_p = float(p)
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {m!r}")
        if self.seed is not None:
            check_seed("seed", self.seed, SEED_LIMIT, "None = unseeded")
        # None is vLLM's default for both lists; a lone string is one stop string.
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if (not isinstance(ids, (list, tuple))
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of non-negative integer token ids, e.g. [2], "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS_TEMPERATURE

    @property
    def priority_level(self) -> int:
        return priority_level(self.priority)

    @property
    def priority_class(self) -> str:
        return priority_class(self.priority)
