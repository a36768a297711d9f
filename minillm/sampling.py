"""The sampler (``SamplingParams`` itself is plain Python, in ``sampling_params.py``).

The sampler turns a row of logits into one token: temperature, then top-k, then
top-p, then a draw. The noise of the draw for the token at position p of a request
comes from (the request's seed, p) alone (``position_noise``), so a seeded request
produces the same text whatever else shares its batch, and whether or not its tokens
were drafted and verified (speculative decoding) or sampled one by one.
Temperature 0 means greedy (argmax), with no randomness at all.

A learner's ``sample_next_token`` (chapter 0) plugged into its seam (``minillm/seams.py``)
picks every row's token in ``sample`` and in the engine's ``sample_at``, one row per call,
with a generator seeded for the row's position as the library's own draw is.
"""
from __future__ import annotations

import math
from array import array
from typing import Sequence

import torch

from . import seams
from .sampling_params import SamplingParams

def _rows_k(top_k: torch.Tensor, V: int) -> torch.Tensor:
    """Logits each row keeps under top-k: its top_k, or all V where it is -1 (or above V)."""
    return torch.where(top_k < 0, torch.full_like(top_k, V), top_k).clamp(max=V)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus.

    logits [B, V] (already divided by temperature); top_k [B] int (-1 = off);
    top_p [B] float (1.0 = off). The nucleus is the smallest set of most likely
    tokens whose probability reaches top_p; the most likely token is always kept.
    """
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(V, device=logits.device)
    k = _rows_k(top_k, V)
    drop = ranks[None, :] >= k[:, None]  # [B, V] outside the top-k
    probs = sorted_logits.masked_fill(drop, -math.inf).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of all more likely tokens
    # top_p 1.0 is off: in float32 the mass before a far tail token can round up to 1.0
    nucleus = top_p < 1.0
    drop |= (mass_before >= top_p[:, None].to(probs.dtype)) & nucleus[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int, some_off: bool = True) -> torch.Tensor:
    """``apply_top_k_top_p`` when no row uses top-p: the same k logits kept per row, found
    with ``topk`` (the ``max_k`` largest) instead of sorting all V of them. ``max_k``: the
    largest top_k of the rows (host side); a row with top_k -1 keeps everything (pass
    ``some_off=False`` when no row has -1: one pass over [B, V] less).

    The sort and ``topk`` both keep exactly k logits, with their values; they could only
    disagree on which of several logits tied at the k-th value survive (neither order is
    specified for ties).
    """
    B, V = logits.shape
    k = _rows_k(top_k, V)  # [B]
    values, index = logits.topk(min(max_k, V), dim=-1)  # [B, max_k], largest first
    keep = torch.arange(values.shape[-1], device=logits.device)[None, :] < k[:, None]
    out = torch.full_like(logits, -math.inf).scatter_(-1, index, values.masked_fill(~keep, -math.inf))
    return torch.where((top_k < 0)[:, None], logits, out) if some_off else out


def param_table_values(params: Sequence[SamplingParams]) -> list[float]:
    """(temperature, top_k, top_p) per row, flat: the table ``compute_probs`` reads.

    top_k and 0/1 are exact in float64, and float32(float64(x)) is the float32 that
    torch.tensor([x]) would give. A greedy row's temperature is 1 (it is never divided by 0).
    """
    out: list[float] = []
    for p in params:
        out += [p.temperature if not p.greedy else 1.0, float(p.top_k), p.top_p]
    return out


def param_table_bits(params: Sequence[SamplingParams]) -> list[int]:
    """``param_table_values`` as the int64 bit patterns of its float64s, to travel in an int64 upload."""
    return array("q", array("d", param_table_values(params)).tobytes()).tolist()


def compute_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                  table: torch.Tensor | None = None) -> torch.Tensor:
    """The exact distribution each row samples from: [B, V] float32.

    Greedy rows get a one-hot on the argmax, so speculative decoding can treat greedy
    as the temperature-0 case of the same rule. ``table``: the rows' (temperature, top_k,
    top_p) already on the device ([B, 3] float64, the engine's step upload carries it);
    None uploads it here.
    """
    logits = logits.float()
    dev = logits.device
    # The greedy check on the host: no step waits on the device here.
    if table is None:
        table = torch.tensor(param_table_values(params), dtype=torch.float64).reshape(-1, 3)
        table = table.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else table
    temp, top_k, top_p = table[:, 0].float(), table[:, 1].long(), table[:, 2].float()
    scaled = logits / temp[:, None]
    if any(p.top_p < 1.0 for p in params):
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    elif any(p.top_k != -1 for p in params):  # top-k alone: no full sort of the vocabulary
        scaled = apply_top_k(scaled, top_k, max(p.top_k for p in params), any(p.top_k == -1 for p in params))
    probs = scaled.softmax(dim=-1)
    greedy = [p.greedy for p in params]
    if all(greedy):
        return torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if any(greedy):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        for i, g in enumerate(greedy):
            if g:
                probs[i] = one_hot[i]
    return probs


def exponential_noise(n: int, V: int, generator: torch.Generator | None = None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """[n, V] float32 draws of Exp(1), as -log(1 - U) with U ~ U[0, 1) from ``generator``.

    One uniform and one log per entry (``Tensor.exponential_`` gives the same law but is
    several times slower on a CPU). 1 - U lies in (0, 1], so every draw is finite and >= 0.
    """
    if generator is not None:
        device = generator.device
    return torch.rand(n, V, generator=generator, device=device).neg_().log1p_().neg_()


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) over the last dim: with noise ~ Exp(1), index i wins with probability probs[i].

    Why: E_i / p_i ~ Exp(rate p_i), and the smallest of independent exponentials is the one
    of rate p_i with probability p_i / sum(p) (the "exponential race"; the same draw as the
    Gumbel-max trick, log p_i - log E_i = log p_i + Gumbel). It needs V random numbers per
    row whatever p is, and the noise can be fixed before p is known: the property that
    speculative verification builds on (``minillm/spec_decode/rejection_sampler.py``,
    ``coupled_verify``). Zero-probability entries score 0, so a noise of exactly 0 cannot
    make 0/0 = nan win the argmax.
    """
    return torch.where(probs > 0, probs / noise, 0.0).argmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row, each row drawing its V exponentials from its own generator, in turn."""
    V = probs.shape[-1]
    noise = torch.cat([exponential_noise(1, V, g, probs.device) for g in generators])
    return exponential_race(probs, noise.to(probs.dtype))


def plugged_rows(mine, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> tokens [B], row b from ``mine(logits[b], temperature, top_k, top_p,
    generators[b])``: a learner's ``sample_next_token`` (chapter 0), one call per row. A
    greedy row passes temperature 0 (however small its own), as ``SamplingParams.greedy`` reads it."""
    out = []
    for b, (row, p, g) in enumerate(zip(logits, params, generators)):
        t = int(mine(row, 0.0 if p.greedy else p.temperature, p.top_k, p.top_p, g))
        _check_plugged_token(t, row, p, b)
        out.append(t)
    return torch.tensor(out, dtype=torch.long, device=logits.device)


def _check_plugged_token(t: int, row: torch.Tensor, p: SamplingParams, b: int) -> None:
    """What the engine relies on of a plugged ``sample_next_token``'s token (chapter 0's contract),
    checked before it is appended to the request: a token id of the vocabulary; the argmax for a
    greedy row (a tie may go to any of the largest logits); for a sampled row, a token that the
    top-k and top-p filter of ``row / temperature`` keeps."""
    V = row.shape[-1]
    if not 0 <= t < V:
        raise seams.SeamContractError("sample_next_token", f"it returns a token id in [0, {V})",
                                      f"sample_next_token returned {t} for row {b}")
    if p.greedy:
        if row[t] != row.max():
            raise seams.SeamContractError(
                "sample_next_token", "temperature 0 is greedy: it returns the argmax of the logits",
                f"row {b}: token {t} (logit {float(row[t]):.6g}), the largest logit is {float(row.max()):.6g} "
                f"(token {int(row.argmax())})")
    elif 0 <= p.top_k < V or p.top_p < 1.0:
        why = _outside_filter(t, row.float() / p.temperature, p.top_k, p.top_p)
        if why:
            raise seams.SeamContractError(
                "sample_next_token", "it samples only tokens that the top-k, then top-p filter of logits / "
                "temperature keeps", f"row {b} (temperature {p.temperature:g}, top_k {p.top_k}, "
                f"top_p {p.top_p:g}): token {t}, {why}")


def _outside_filter(t: int, scaled: torch.Tensor, top_k: int, top_p: float) -> str:
    """Why token ``t`` is outside the top-k, then top-p filter of ``scaled`` [V], or "" if it is in.
    Lenient where a correct filter may differ from ``apply_top_k_top_p``: a logit tied with the k-th
    largest is in the top-k, and the nucleus is judged by the mass of the strictly more likely tokens."""
    value = scaled[t]
    survivors = torch.ones_like(scaled, dtype=torch.bool)
    if 0 <= top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k).values[-1]
        if value < kth:
            return f"not among the top {top_k} logits"
        survivors = scaled >= kth
    if top_p < 1.0:
        probs = scaled.masked_fill(~survivors, -math.inf).softmax(-1)
        ahead = float(probs[scaled > value].sum())
        if ahead >= top_p + 1e-4:  # float rounding of a correct cumulative sum stays far below that
            return f"the tokens more likely than it already hold {ahead:.4f} of the probability, top_p {top_p:g}"
    return ""


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]. Greedy rows take the argmax and draw nothing."""
    mine = seams.plugged("sample_next_token")  # a learner's sampler (chapter 0), when plugged in
    if mine is not None:
        return plugged_rows(mine, logits, params, generators)
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = compute_probs(logits[rows], [params[i] for i in rows])
        out[rows] = sample_from_probs(probs, [generators[i] for i in rows])
    return out


# ---------------------------------------------------------------- noise per token position
#
# The engine does not draw from a running stream. The noise of the token that lands at
# index ``position`` of a request's ``all_token_ids`` is a function of (request seed,
# position) only. A plain decode step, a speculative step that verifies 4 drafts, the
# draft model proposing them: whoever looks at position p uses the same E_p. So a seeded
# request's tokens cannot depend on how many drafts a step made, which depends on the
# batch (the off switch, the token budget, free blocks) -- and speculative verification
# can emit exactly the tokens plain sampling would have (``coupled_verify``).

_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """The SplitMix64 mixer (Steele, Lea and Flood 2014): a bijection of 64-bit integers
    under which nearby inputs give unrelated outputs."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix32(x: int) -> int:
    """A bijection of 32-bit integers that scatters nearby inputs (xorshift-multiply rounds)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def noise_seed(seed: int, position: int) -> int:
    """The generator seed, in [0, 2**64), of the noise for token ``position`` of a request seeded ``seed``.

    torch's CPU generator (a Mersenne Twister) keeps only the low 32 bits of a seed:
    ``manual_seed(1)`` and ``manual_seed(1 + 2**32)`` give the same numbers. So the low 32
    bits are a bijection of (request hash + position) mod 2**32: two positions of one
    request never share noise. The high 32 bits are the request's hash (a CUDA generator
    uses all 64). Two *different* requests can still meet on 32 bits (about L / 2**31 per
    pair for L positions): that correlates two requests' tokens at one position, never the
    distribution of either request.
    """
    h = _splitmix64(seed)
    return (h & ~_M32 & _M64) | _mix32((h + position) & _M32)


def position_noise(seed: int | None, positions: Sequence[int], V: int, generator: torch.Generator | None = None,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """[len(positions), V] of Exp(1): row j is the noise of token ``positions[j]`` of a request seeded ``seed``.

    ``generator`` is scratch space (re-seeded for every row; its device is the output's);
    None makes one. ``seed=None`` draws from the global generator instead (unseeded).
    Cost: one ``manual_seed`` (about a microsecond) and V uniforms per position, the same
    V numbers per sampled token that any exponential race needs.
    """
    if seed is None:
        return exponential_noise(len(positions), V, None, device)
    if generator is None:
        generator = torch.Generator(device=device if device is not None else "cpu")
    rows = []
    for pos in positions:
        generator.manual_seed(noise_seed(seed, pos))
        rows.append(exponential_noise(1, V, generator))
    return torch.cat(rows) if rows else torch.empty(0, V, device=generator.device)


def sample_from_probs_at(probs: torch.Tensor, seeds: Sequence[int | None], positions: Sequence[int],
                         generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
    """probs [B, V] -> tokens [B]: row b is the exponential race with the noise of (seeds[b], positions[b])."""
    B, V = probs.shape
    gens = [None] * B if generators is None else generators
    device = next((g.device for g in gens if g is not None), probs.device)
    if any(g is not None and g.device != device for g in gens):  # mixed devices: row by row
        noise = torch.cat([position_noise(s, [pos], V, g, probs.device) for s, pos, g in zip(seeds, positions, gens)])
        return exponential_race(probs, noise.to(probs.device, probs.dtype))
    # position_noise's numbers, drawn into one buffer: each row seeded and transformed on its own
    # (the same ops on the same V numbers, so bit for bit the same), without a tensor and a cat a row.
    noise = torch.empty(B, V, device=device)
    scratch = None
    for b, (s, pos, g) in enumerate(zip(seeds, positions, gens)):
        row = noise[b]
        if s is None:
            torch.rand(V, out=row)  # unseeded: the global generator, as exponential_noise draws it
        else:
            if g is None:
                g = scratch = scratch or torch.Generator(device=device)
            g.manual_seed(noise_seed(s, pos))
            torch.rand(V, generator=g, out=row)
        row.neg_().log1p_().neg_()
    return exponential_race(probs, noise.to(probs.device, probs.dtype))


def sample_at(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int | None],
              positions: Sequence[int], generators: Sequence[torch.Generator | None] | None = None,
              table: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's sampler: logits [B, V] -> tokens [B], row b landing at ``positions[b]`` of its request.

    Greedy rows take the argmax and draw nothing; the others are
    argmax(probs / E) with E = ``position_noise(seeds[b], [positions[b]])``. ``table``: the
    rows' parameters on the device (``compute_probs``), or None.

    A plugged ``sample_next_token`` picks each row's token instead (``sample_at_plugged``).
    """
    mine = seams.plugged("sample_next_token")  # a learner's sampler (chapter 0), when plugged in
    if mine is not None:
        return sample_at_plugged(mine, logits, params, seeds, positions, generators)
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    gens = None if generators is None else [generators[i] for i in rows]
    if len(rows) == len(params):  # nobody greedy: no rows to pick out
        return sample_from_probs_at(compute_probs(logits, params, table), seeds, positions, gens)
    # Rows picked by slicing with host integers: a list index would upload an index tensor.
    sub = None if table is None else torch.stack([table[i] for i in rows])
    probs = compute_probs(torch.stack([logits[i] for i in rows]), [params[i] for i in rows], sub)
    tokens = sample_from_probs_at(probs, [seeds[i] for i in rows], [positions[i] for i in rows], gens)
    for j, i in enumerate(rows):
        out[i] = tokens[j]
    return out


def sample_at_plugged(mine, logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int | None],
                      positions: Sequence[int], generators: Sequence[torch.Generator | None] | None = None
                      ) -> torch.Tensor:
    """``sample_at`` through a learner's ``sample_next_token`` (chapter 0), one row per call.

    A sampled row of a seeded request gets its generator seeded for its position
    (``noise_seed``), as ``position_noise`` seeds it for the library's draw: a sampler that
    draws its V uniforms from it as ``sample_from_probs`` does (the reference answer calls
    ``sample``) picks the library's very token. A greedy row's generator is left as it is,
    an unseeded request's is None (torch's global generator).
    """
    gens: list[torch.Generator | None] = []
    for b, (p, s) in enumerate(zip(params, seeds)):
        g = None if generators is None else generators[b]
        if not p.greedy:
            if s is None:
                g = None
            else:
                g = torch.Generator(device=logits.device) if g is None else g
                g.manual_seed(noise_seed(s, positions[b]))
        gens.append(g)
    return plugged_rows(mine, logits, params, gens)


def noise_for_rows(params: Sequence[SamplingParams], seeds: Sequence[int | None], starts: Sequence[int], n: int,
                   V: int, generators: Sequence[torch.Generator | None] | None = None,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """[B, n, V]: row b's noise at positions starts[b] .. starts[b] + n - 1; all ones for a greedy row.

    A greedy row's probabilities are one-hot, so any positive noise gives its argmax:
    it draws nothing.
    """
    gens = [None] * len(params) if generators is None else generators
    out = torch.ones(len(params), n, V, device=device)
    for b, (p, s, start, g) in enumerate(zip(params, seeds, starts, gens)):
        if not p.greedy:
            out[b] = position_noise(s, range(start, start + n), V, g, device).to(out.device)
    return out
