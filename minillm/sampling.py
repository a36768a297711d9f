"""SamplingParams (validated at construction) and the sampler.

The sampler turns a row of logits into one token: temperature, then top-k, then
top-p, then a draw. Each request owns a ``torch.Generator``, and draws only from it,
so a seeded request produces the same text whatever else shares its batch.
Temperature 0 means greedy (argmax), with no randomness at all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .config import SEED_LIMIT, check_bool_fields, check_seed

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

    def __post_init__(self) -> None:
        check_bool_fields(self)
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


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus.

    logits [B, V] (already divided by temperature); top_k [B] int (-1 = off);
    top_p [B] float (1.0 = off). The nucleus is the smallest set of most likely
    tokens whose probability reaches top_p; the most likely token is always kept.
    """
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(V, device=logits.device)
    k = torch.where(top_k < 0, torch.full_like(top_k, V), top_k).clamp(max=V)
    drop = ranks[None, :] >= k[:, None]  # [B, V] outside the top-k
    probs = sorted_logits.masked_fill(drop, -math.inf).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of all more likely tokens
    drop |= mass_before >= top_p[:, None].to(probs.dtype)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def compute_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The exact distribution each row samples from: [B, V] float32.

    Greedy rows get a one-hot on the argmax, so speculative decoding can treat greedy
    as the temperature-0 case of the same rule.
    """
    logits = logits.float()
    B, V = logits.shape
    dev = logits.device
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    top_k = torch.tensor([p.top_k for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    scaled = logits / temp[:, None]
    if any(p.top_k != -1 or p.top_p < 1.0 for p in params):
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row, each row drawing only from its own generator.

    Uses the exponential-race trick: argmax(p / E) with E ~ Exp(1) picks index i with
    probability p_i, and needs exactly V random numbers per row, whatever p is.
    """
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for i, g in enumerate(generators):
        e = torch.empty_like(probs[i]).exponential_(generator=g)
        out[i] = (probs[i] / e).argmax()
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]. Greedy rows take the argmax and draw nothing."""
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = compute_probs(logits[rows], [params[i] for i in rows])
        out[rows] = sample_from_probs(probs, [generators[i] for i in rows])
    return out
