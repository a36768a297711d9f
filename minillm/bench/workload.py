"""Seeded synthetic traffic: who asks for how much, and when.

A workload is a list of requests, each a prompt (token ids), a fixed number of new
tokens (``max_tokens`` with ``ignore_eos``: every engine does exactly the same work on
it, whatever the model says) and an arrival time. Same name + same seed = same requests.

Length mixes (``WORKLOADS``):

    uniform   every request alike: ~32-token prompts, exactly ``output_len`` new tokens.
              Nothing for continuous batching to win: all members of a batch end together.
    skewed    the barrel effect: most requests want ~20 new tokens, one in every
              ``long_every`` wants ~``long_tokens`` (800). In each consecutive group of 8
              exactly one is long, at a seeded position.
    chat      a realistic mix: log-normal prompt (median ~100) and output (median ~120)
              lengths, clipped, the long tails of real chat traffic.
    long-prompt-arrival
              requests already decoding when long prompts arrive (chapter 4): all but
              ``num_long`` requests have short prompts and ~``short_output`` (96) new
              tokens and arrive at t=0; then ``num_long`` (3) prompts of ~``long_prompt``
              (1536) tokens arrive at ``first_arrival_s`` + k * ``arrival_gap_s``. Its
              arrivals are part of the workload ("scripted"): no request rate.
    grounded  chat requests whose answer copies from the prompt (repeat a passage, fix its
              typos, quote it, edit code; ``minillm/bench/prompts.py``), ``output_len`` (48)
              new tokens: where prompt lookup drafts well (chapter 5).
    open      chat requests for free generation (a story, an explanation), ``output_len`` (64).

Many users (chapter 6):

    shared-prefix   every request starts with the same ~``system_len`` (512) token system
                    prompt, then a short question of its own (numbered, so no two are
                    equal), ``output_len`` (16) new tokens: what a prefix cache reuses.
    multi-turn      conversations of ``turns`` (4) turns; each turn resends the whole
                    history (system prompt, earlier questions and answers) plus a new
                    question. Turn k of every conversation comes before turn k + 1; with
                    ``turn_gap_s`` > 0 turn k arrives at (k - 1) * turn_gap_s.
    mixed-priority  interactive chat over a background of long batch jobs: a share
                    ``batch_fraction`` (0.25) of the requests are "batch" (~``batch_prompt``
                    384-token prompts, ``batch_output`` 96 new tokens), all queued at t=0
                    (or Poisson at ``batch_rate``); the rest are "interactive" (~``chat_prompt``
                    48 tokens, ``chat_output`` 16 new tokens) arriving Poisson at
                    ``interactive_rate`` (4) requests/s. Each request carries its class
                    (``WorkloadRequest.priority``).

Arrivals: ``offline`` (everything at t=0: a batch job) or ``poisson`` at ``rate``
requests per second (exponential gaps: independent users).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from minillm.bench.prompts import INSTRUCTIONS
from minillm.sampling_params import SamplingParams

ARRIVALS = ("offline", "poisson")

# A small prompt set: instructions (minillm/bench/prompts.py), and a passage used as context to
# lengthen prompts.
PROMPTS = INSTRUCTIONS

PASSAGE = (
    "The old lighthouse stood at the end of a narrow stone pier. For more than a hundred "
    "years its keepers climbed the spiral stairs each evening to light the lamp, polish the "
    "great glass lens and write the weather in a thick leather book. Ships passing the rocky "
    "coast watched for its slow white flash, once every ten seconds, and knew where they were. "
    "When the lamp was finally automated, the last keeper moved to the village, but he still "
    "walked out along the pier every night to watch the beam sweep across the dark water. "
    "Children from the school came to hear his stories about storms, shipwrecks and rescues, "
    "about the winter the sea froze in the harbour, and about the seal that slept on the "
    "steps every summer. "
)


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float  # seconds after the start of the run
    priority: str | int = "standard"  # the request's class (mixed-priority); SamplingParams.priority

    def sampling_params(self) -> SamplingParams:
        """Greedy, exactly ``max_tokens`` new tokens: identical work in every engine."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, priority=self.priority)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens


@dataclass
class Workload:
    name: str
    seed: int
    arrival: str
    rate: float | None
    requests: list[WorkloadRequest]
    params: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_total_tokens(self) -> int:
        """The longest request, prompt plus output: the smallest max_model_len that fits all."""
        return max(r.max_total_tokens for r in self.requests)

    def default_max_model_len(self, multiple: int = 256) -> int:
        """The longest request rounded up to ``multiple``: the KV region each slot reserves."""
        return multiple * math.ceil(self.max_total_tokens / multiple)

    def describe(self) -> str:
        outs = sorted(r.max_tokens for r in self.requests)
        arrival = f"poisson {self.rate:g} req/s" if self.arrival == "poisson" else self.arrival
        return (f"{self.name}: {len(self)} requests, {arrival}, prompt tokens {self.prompt_tokens}, "
                f"output tokens {self.output_tokens} (min {outs[0]}, median {outs[len(outs) // 2]}, "
                f"max {outs[-1]})")


# -- lengths --------------------------------------------------------------------------

def _uniform_lengths(rng: random.Random, n: int, prompt_len: int = 32, output_len: int = 64):
    prompts = [rng.randint(max(4, prompt_len * 3 // 4), prompt_len * 5 // 4) for _ in range(n)]
    return prompts, [output_len] * n


def _skewed_lengths(rng: random.Random, n: int, short_tokens: int = 20, long_tokens: int = 800,
                    long_every: int = 8, prompt_len: int = 32):
    prompts = [rng.randint(max(4, prompt_len // 2), prompt_len * 3 // 2) for _ in range(n)]
    jitter = lambda base, frac: max(1, base + rng.randint(-int(base * frac), int(base * frac)))  # noqa: E731
    outs = [jitter(short_tokens, 0.2) for _ in range(n)]
    for g in range(0, n, long_every):  # one long request in every group of ``long_every``
        size = min(long_every, n - g)
        if size == long_every or g == 0:
            outs[g + rng.randrange(size)] = jitter(long_tokens, 0.05)
    return prompts, outs


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def _chat_lengths(rng: random.Random, n: int, prompt_median: int = 100, output_median: int = 120,
                  max_prompt: int = 512, max_output: int = 512):
    prompts = [_lognormal(rng, prompt_median, 0.8, 8, max_prompt) for _ in range(n)]
    outs = [_lognormal(rng, output_median, 0.9, 4, max_output) for _ in range(n)]
    return prompts, outs


def _long_prompt_arrival(rng: random.Random, n: int, short_prompt: int = 32, short_output: int = 96,
                         num_long: int = 3, long_prompt: int = 1536, long_output: int = 16,
                         first_arrival_s: float = 1.0, arrival_gap_s: float = 3.0):
    # Sizes for a CPU (a 1.5k-token prefill takes seconds); on a GPU give thousands more.
    if not 1 <= num_long < n:
        raise ValueError(f"long-prompt-arrival needs 1 <= num_long < num_requests (someone must be decoding "
                         f"when the long prompts arrive), got num_long={num_long} of {n} requests")
    if first_arrival_s < 0 or arrival_gap_s < 0:
        raise ValueError("first_arrival_s and arrival_gap_s must be >= 0 seconds")
    jitter = lambda base, frac: max(1, base + rng.randint(-int(base * frac), int(base * frac)))  # noqa: E731
    num_short = n - num_long
    prompts = [jitter(short_prompt, 0.25) for _ in range(num_short)] + [jitter(long_prompt, 0.05)
                                                                         for _ in range(num_long)]
    outs = [jitter(short_output, 0.1) for _ in range(num_short)] + [long_output] * num_long
    times = [0.0] * num_short + [first_arrival_s + k * arrival_gap_s for k in range(num_long)]
    return prompts, outs, times


def _grounded_lengths(rng: random.Random, n: int, output_len: int = 48):
    # Prompt lengths are the chat tasks' own; these nominal ones only size dummy-weight prompts.
    return [85] * n, [output_len] * n


def _open_lengths(rng: random.Random, n: int, output_len: int = 64):
    return [40] * n, [output_len] * n


@dataclass(slots=True)
class Plan:
    """Prompts made of named parts: equal names are equal token ids (a shared system prompt,
    the history of a conversation). A part is (name, kind, nominal length); ``kind`` says
    how ``make_workload`` writes it with a tokenizer: "system" and "answer" are passage
    text of exactly that length, "question" a numbered question (its own length),
    "unique" a prompt of its own as the other workloads make them."""

    parts: list[list[tuple[str, str, int]]]
    output_lens: list[int]
    times: list[float] | None = None  # scripted arrivals (None: offline, or the caller's Poisson)
    priorities: list[str] | None = None


def _shared_prefix(rng: random.Random, n: int, system_len: int = 512, question_len: int = 12,
                   output_len: int = 16):
    parts = [[("system", "system", system_len), (f"q{i}", "question", question_len)] for i in range(n)]
    return Plan(parts, [output_len] * n)


def _multi_turn(rng: random.Random, n: int, turns: int = 4, system_len: int = 64, question_len: int = 16,
                answer_len: int = 48, output_len: int = 24, turn_gap_s: float = 0.0):
    convs = -(-n // turns)
    parts, times = [], []
    for k in range(turns):  # turn-major: every conversation's turn k before any turn k + 1
        for c in range(convs):
            if len(parts) == n:
                break
            history = [("system", "system", system_len)]
            for j in range(k):
                history += [(f"c{c}q{j}", "question", question_len), (f"c{c}a{j}", "answer", answer_len)]
            parts.append(history + [(f"c{c}q{k}", "question", question_len)])
            times.append(k * turn_gap_s)
    return Plan(parts, [output_len] * n, times if turn_gap_s else None)


def _mixed_priority(rng: random.Random, n: int, batch_fraction: float = 0.25, chat_prompt: int = 48,
                    chat_output: int = 16, batch_prompt: int = 384, batch_output: int = 96,
                    interactive_rate: float = 4.0, batch_rate: float = 0.0):
    if not 0 <= batch_fraction <= 1:
        raise ValueError(f"workload 'mixed-priority': batch_fraction must be in [0, 1], got {batch_fraction!r}")
    if interactive_rate <= 0:
        raise ValueError("workload 'mixed-priority': interactive_rate must be > 0 requests per second")
    num_batch = round(n * batch_fraction)
    classes = ["batch"] * num_batch + ["interactive"] * (n - num_batch)
    jitter = lambda base, frac: max(1, base + rng.randint(-int(base * frac), int(base * frac)))  # noqa: E731
    t_batch = t_chat = 0.0
    items = []
    for i, cls in enumerate(classes):
        if cls == "batch":
            length, out, t = jitter(batch_prompt, 0.1), jitter(batch_output, 0.1), t_batch
            t_batch += rng.expovariate(batch_rate) if batch_rate > 0 else 0.0
        else:
            t_chat += rng.expovariate(interactive_rate)  # the first chat arrives after the background started
            length, out, t = jitter(chat_prompt, 0.25), jitter(chat_output, 0.25), t_chat
        items.append((t, i, cls, length, out))
    items.sort()
    return Plan([[(f"u{i}", "unique", length)] for _, i, _, length, _ in items], [o for *_, o in items],
                [t for t, *_ in items], [c for _, _, c, _, _ in items])


WORKLOADS = {"uniform": _uniform_lengths, "skewed": _skewed_lengths, "chat": _chat_lengths,
             "long-prompt-arrival": _long_prompt_arrival, "grounded": _grounded_lengths, "open": _open_lengths,
             "shared-prefix": _shared_prefix, "multi-turn": _multi_turn, "mixed-priority": _mixed_priority}
CHAT_TASK_WORKLOADS = ("grounded", "open")  # prompts are chat tasks, not passage + question


@dataclass(frozen=True, slots=True)
class ParamRule:
    """A length-mix parameter: an integer (``kind=int``) or any real number (``float``), >= ``low``
    (> ``low`` when ``strict``)."""

    kind: type
    low: float
    strict: bool = False

    def check(self, workload: str, name: str, value: Any) -> None:
        ok = not isinstance(value, bool) and isinstance(value, int if self.kind is int else (int, float))
        ok = ok and not (isinstance(value, float) and not math.isfinite(value))
        ok = ok and (value > self.low if self.strict else value >= self.low)
        if not ok:
            what = "an integer" if self.kind is int else "a number"
            bound = f"{'>' if self.strict else '>='} {self.low:g}"
            raise ValueError(f"workload {workload!r}: {name} must be {what} {bound}, got {value!r}")


_COUNT, _TOKENS, _SECONDS = ParamRule(int, 1), ParamRule(int, 1), ParamRule(float, 0)
# Each length function's parameters (names must match its signature). A wrong value would
# otherwise surface as an empty range deep in ``random`` that names no parameter, or pass
# silently (2.5 tokens). The lows keep every drawn length >= 1: uniform draws prompts from
# [max(4, 3p/4), 5p/4], which needs p >= 4; skewed from [max(4, p/2), 3p/2], p >= 3.
WORKLOAD_PARAMS: dict[str, dict[str, ParamRule]] = {
    "uniform": {"prompt_len": ParamRule(int, 4), "output_len": _TOKENS},
    "skewed": {"short_tokens": _TOKENS, "long_tokens": _TOKENS, "long_every": _COUNT,
               "prompt_len": ParamRule(int, 3)},
    "chat": {"prompt_median": ParamRule(float, 0, strict=True), "output_median": ParamRule(float, 0, strict=True),
             "max_prompt": _TOKENS, "max_output": _TOKENS},
    "long-prompt-arrival": {"short_prompt": _TOKENS, "short_output": _TOKENS, "num_long": _COUNT,
                            "long_prompt": _TOKENS, "long_output": _TOKENS, "first_arrival_s": _SECONDS,
                            "arrival_gap_s": _SECONDS},
    "grounded": {"output_len": _TOKENS},
    "open": {"output_len": _TOKENS},
    "shared-prefix": {"system_len": _TOKENS, "question_len": _TOKENS, "output_len": _TOKENS},
    "multi-turn": {"turns": _COUNT, "system_len": _TOKENS, "question_len": _TOKENS, "answer_len": _TOKENS,
                   "output_len": _TOKENS, "turn_gap_s": _SECONDS},
    "mixed-priority": {"batch_fraction": ParamRule(float, 0), "chat_prompt": _TOKENS, "chat_output": _TOKENS,
                       "batch_prompt": _TOKENS, "batch_output": _TOKENS,
                       "interactive_rate": ParamRule(float, 0, strict=True), "batch_rate": _SECONDS},
}


def check_workload_params(name: str, params: dict[str, Any]) -> None:
    """Reject an unknown parameter of workload ``name``, or a value of the wrong type or range."""
    rules = WORKLOAD_PARAMS[name]
    unknown = sorted(set(params) - set(rules))
    if unknown:
        raise ValueError(f"bad parameter for workload {name!r}: unknown {', '.join(unknown)}; "
                         f"valid parameters: {', '.join(rules)}")
    for key, value in params.items():
        rules[key].check(name, key, value)


# -- prompts --------------------------------------------------------------------------

def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _prompt_ids(tokenizer, rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """A prompt of exactly ``length`` tokens: passage context, then an instruction."""
    if tokenizer is None:  # no tokenizer (dummy weights): seeded ids, avoiding the special ones
        return [rng.randrange(16, vocab_size) for _ in range(length)]
    question = _encode(tokenizer, "\n\nQuestion: " + rng.choice(PROMPTS) + "\nAnswer:")
    if len(question) >= length:
        return question[-length:]
    passage = _encode(tokenizer, PASSAGE)
    start = rng.randrange(len(passage))
    need = length - len(question)
    context = (passage[start:] + passage * (need // len(passage) + 1))[:need]
    return context + question


def _part_ids(tokenizer, name: str, kind: str, length: int, seed: int, vocab_size: int) -> list[int]:
    """The token ids of one named prompt part (the same for every prompt that names it)."""
    rng = random.Random(f"part:{seed}:{name}")
    if tokenizer is None:
        return [rng.randrange(16, vocab_size) for _ in range(length)]
    if kind == "question":
        num = int(name.rsplit("q", 1)[-1]) + 1  # q3 -> question 4 (of a conversation, or of the run)
        return _encode(tokenizer, f"\n\nQuestion {num}: {rng.choice(PROMPTS)}\nAnswer:")
    if kind == "unique":
        return _prompt_ids(tokenizer, rng, length, vocab_size)
    passage = _encode(tokenizer, ("You are a helpful assistant. " if kind == "system" else "") + PASSAGE)
    start = 0 if kind == "system" else rng.randrange(len(passage))
    return (passage[start:] + passage * (length // len(passage) + 1))[:length]


def _plan_requests(plan: Plan, tokenizer, seed: int, vocab_size: int) -> list[list[int]]:
    cache: dict[str, list[int]] = {}
    prompts = []
    for parts in plan.parts:
        ids: list[int] = []
        for name, kind, length in parts:
            if name not in cache:
                cache[name] = _part_ids(tokenizer, name, kind, length, seed, vocab_size)
            ids += cache[name]
        prompts.append(ids)
    return prompts


def make_workload(name: str, num_requests: int, seed: int = 0, tokenizer=None, *, arrival: str = "offline",
                  rate: float | None = None, vocab_size: int = 49152, **params: Any) -> Workload:
    """Build workload ``name`` (see ``WORKLOADS``) of ``num_requests`` requests.

    ``params`` tune the length mix (e.g. ``long_tokens=400`` for ``skewed``,
    ``output_len=32`` for ``uniform``). ``arrival='poisson'`` needs ``rate`` > 0 requests/s.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}")
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if arrival not in ARRIVALS:
        raise ValueError(f"unknown arrival {arrival!r}; valid arrivals: {', '.join(ARRIVALS)}")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not math.isfinite(rate) or rate < 0):
        raise ValueError(f"rate must be a number >= 0 requests per second (0 or None = offline), got {rate!r}")
    if arrival == "poisson" and not rate:
        raise ValueError("arrival='poisson' needs rate > 0 (requests per second)")
    if arrival == "offline" and rate:
        arrival = "poisson"  # a rate given means the caller wants arrivals spread out
    check_workload_params(name, params)
    try:
        made = WORKLOADS[name](random.Random(f"{name}:{seed}:lengths"), num_requests, **params)
    except TypeError as e:
        raise ValueError(f"bad parameter for workload {name!r}: {e}") from None
    if isinstance(made, Plan):  # prompts made of shared parts (chapter 6)
        return _workload_from_plan(name, seed, made, tokenizer, arrival, rate, vocab_size, params)
    prompt_lens, output_lens, *scripted = made
    if scripted and arrival == "poisson":
        raise ValueError(f"workload {name!r} brings its own arrival times: give no request rate")
    if min(prompt_lens) < 1 or min(output_lens) < 1:
        raise ValueError(f"workload {name!r} with {params} produced an empty prompt or output")
    rng = random.Random(f"{name}:{seed}:prompts")
    if name in CHAT_TASK_WORKLOADS and tokenizer is not None:
        from minillm.bench.prompts import chat_prompts

        prompts = chat_prompts(tokenizer, name, num_requests)
    else:
        prompts = [_prompt_ids(tokenizer, rng, p, vocab_size) for p in prompt_lens]
    times = [0.0] * num_requests
    if arrival == "poisson":
        arng, t = random.Random(f"{name}:{seed}:arrivals"), 0.0
        for i in range(num_requests):
            times[i] = t
            t += arng.expovariate(rate)
    if scripted:
        times, arrival = list(scripted[0]), "scripted"
    reqs = [WorkloadRequest(str(i), p, o, a) for i, (p, o, a) in enumerate(zip(prompts, output_lens, times))]
    return Workload(name, seed, arrival, rate if arrival == "poisson" else None, reqs, dict(params))


def _workload_from_plan(name: str, seed: int, plan: Plan, tokenizer, arrival: str, rate: float | None,
                        vocab_size: int, params: dict[str, Any]) -> Workload:
    n = len(plan.parts)
    if plan.times is not None and arrival == "poisson":
        raise ValueError(f"workload {name!r} with these parameters brings its own arrival times: give no request rate")
    prompts = _plan_requests(plan, tokenizer, seed, vocab_size)
    times = [0.0] * n
    if plan.times is not None:
        times, arrival = list(plan.times), "scripted"
    elif arrival == "poisson":
        arng, t = random.Random(f"{name}:{seed}:arrivals"), 0.0
        for i in range(n):
            times[i] = t
            t += arng.expovariate(rate)
    classes = plan.priorities or ["standard"] * n
    reqs = [WorkloadRequest(str(i), p, o, a, c)
            for i, (p, o, a, c) in enumerate(zip(prompts, plan.output_lens, times, classes))]
    return Workload(name, seed, arrival, rate if arrival == "poisson" else None, reqs, dict(params))


def workload_from_lengths(prompt_lens: Sequence[int], output_lens: Sequence[int], tokenizer=None, seed: int = 0,
                          arrival_times: Sequence[float] | None = None, vocab_size: int = 49152) -> Workload:
    """A hand-made workload: one request per (prompt length, output length) pair."""
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError("give one output length per prompt length, and at least one request")
    rng = random.Random(f"custom:{seed}")
    times = list(arrival_times) if arrival_times is not None else [0.0] * len(prompt_lens)
    reqs = [WorkloadRequest(str(i), _prompt_ids(tokenizer, rng, p, vocab_size), o, a)
            for i, (p, o, a) in enumerate(zip(prompt_lens, output_lens, times))]
    return Workload("custom", seed, "offline" if not any(times) else "custom", None, reqs)


__all__ = ["Plan", "Workload", "WorkloadRequest", "WORKLOADS", "WORKLOAD_PARAMS", "ARRIVALS", "PROMPTS", "make_workload",
           "workload_from_lengths", "check_workload_params"]
