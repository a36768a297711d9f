"""The capstone's last row: one engine built from every piece at once.

    python -m minillm capstone --impl exercises --all

Every seam of the paged engine is plugged at the same time: the model's norm, RoPE and
sampler (chapter 0), blocks, slots, allocation, preemption victim, decode attention and
the K/V store (chapter 3), the chunked-prefill budget split (chapter 4), the speculative
verifier, drafter, roll-back and draft-length policy (chapter 5), the prefix lookup,
eviction and admission order (chapter 6), and the arrivals, goodput and token-budget
controller (chapter 7). The engine is paged with chunked prefill, prefix caching,
priority classes with queue timeouts and n-gram speculation. It serves a batch of chat
requests (a shared system prompt, three priority classes, one sampled request with a
seed) arriving at the Poisson arrival times, then one request through the
OpenAI-compatible server. The same run with nothing plugged is the reference.

Time is modelled, not measured: the engine's clock advances after each step by the cost
model's prediction for that step (``CostModel``'s defaults, the same in both runs). So
queue timeouts, the controller's p95 inter-token latency, TTFT and goodput are the same
numbers in both runs and the two schedules can be compared step by step; how fast the
real forward was is the per-piece rows' business. The server request runs on wall time
(its tokens are compared, not its schedule).
"""
from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Sequence

from minillm import seams

# The engine every piece runs in, at once.
ENGINE = dict(engine="paged", max_num_seqs=4, block_size=8, num_blocks=16, max_model_len=128,
              enable_chunked_prefill=True, max_num_batched_tokens=24, enable_prefix_caching=True,
              scheduling_policy="priority", attention_backend="torch",
              queue_timeouts={"interactive": 0.2, "standard": 0.6, "batch": 2.0},
              speculative=dict(method="ngram", num_speculative_tokens=3, adaptive=True,
                               disable_by_batch_size=None))
SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = [  # (class, question, max tokens)
    ("interactive", "What is the capital of France?", 10),
    ("batch", "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, "
              "Sunday. Again: Monday, Tuesday, Wednesday,", 24),
    ("standard", "Name three primary colors.", 12),
    ("interactive", "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", 16),
    ("batch", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n", 20),
    ("standard", "What is the capital of France?", 10),
    ("standard", "Write the alphabet: a b c d e f g h i j k l m n o p", 16),
    ("interactive", "Name three primary colors.", 8),
]
SAMPLED = 2  # this request samples (temperature 0.8, its own seed): the sampler and the verifier's rule
RATE = 4.0  # requests per modelled second
SEED = 7
CONTROL_EVERY = 4  # steps between two decisions of the token-budget controller
ITL_TARGET = 0.075  # modelled seconds: the controller's p95 inter-token latency target
MIN_BUDGET, MAX_BUDGET = 16, 64
SLO_TTFT, SLO_TPOT = 1.0, 0.15  # modelled seconds, for goodput
SERVER_QUESTION = "Name the largest planet of the solar system."
SERVER_MAX_TOKENS = 12

# The seams this engine exercises; static_schedule and schedule_step belong to the other
# engines, chapter 9's to a host KV tier and to the SLO controller and A/B table (this
# engine's budget is chapter 7's controller), chapter 8's to an engine whose Medusa heads draft
# a candidate tree (this one drafts with n-grams), chapter 10's to an engine split over processes,
# chapter 11's to a quantized engine whose learner's paths are slow (a dequantized weight per
# call, a kernel in Triton's interpreter): their own rows of the capstone.
OTHER_ENGINES = ("static_schedule", "schedule_step", "blocks_to_offload", "slo_decision", "bootstrap_ci",
                 "tree_attention_mask", "longest_accepted_path", "multi_candidate_rule",
                 "shard_linear", "parallel_mlp", "allreduce_bytes_per_step",
                 "quantize_groups", "dequantize_groups", "int8_gemv_triton")


@dataclass
class AllRun:
    """What one run of the assembled engine produced: everything the comparison looks at."""

    tokens: list[list[int]]
    schedule: list[tuple]
    arrivals: list[float]
    budgets: list[tuple[int, int]]  # (step, new budget)
    goodput: float
    prefix_hit_tokens: int
    preemptions: int
    server_text: str
    server_tokens: int
    blocks_free: bool
    calls: dict[str, int] = field(default_factory=dict)


@dataclass
class Check:
    what: str
    same: bool
    detail: str = ""


def _counted(name: str, fn: Callable, calls: dict[str, int]) -> Callable:
    def call(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    call.__name__ = name
    return call


def _blocks_free(engine) -> bool:
    bm = engine.scheduler.block_manager
    try:
        bm.check_invariants()
    except AssertionError:
        return False
    return bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished()


def _recent_itl_p95(requests, since: float) -> float | None:
    from minillm.bench.sweep import recent_itl_p95

    return recent_itl_p95(requests, since)


def _serve_one(engine) -> tuple[str, int]:
    """One chat completion through the OpenAI-compatible server, on this engine."""
    from minillm.clock import WallClock
    from minillm.serving.async_llm import AsyncLLM
    from minillm.serving.server import DEFAULT_MODEL_NAME, serve_in_background

    engine.clock = WallClock()
    engine.scheduler.clock = engine.clock.now
    llm = AsyncLLM(engine)
    try:
        with serve_in_background(async_llm=llm) as server:
            body = json.dumps({"model": DEFAULT_MODEL_NAME, "temperature": 0.0, "max_tokens": SERVER_MAX_TOKENS,
                               "messages": [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": SERVER_QUESTION}]}).encode()
            req = urllib.request.Request(f"{server.url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                reply = json.loads(resp.read())
            time.sleep(0.05)  # let the engine thread retire the finished request
    finally:
        llm.shutdown()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


def run_assembled(lab, impls: dict[str, Callable] | None = None) -> AllRun:
    """The assembled engine's run: ``impls`` plugged into their seams (None: the library's)."""
    from minillm.bench import loadgen
    from minillm.bench.cost_model import CostModel, record_features
    from minillm.bench.sweep import slo_token_budget
    from minillm.clock import VirtualClock
    from minillm.sampling_params import SamplingParams
    from minillm.serving.encoder import chat_prompt_ids

    calls: dict[str, int] = {}
    plugged = {n: _counted(n, f, calls) for n, f in (impls or {}).items()}
    cost = CostModel()
    with seams.plug(**plugged):
        eng = lab.engine(**ENGINE)
        clock = VirtualClock()
        eng.clock = clock
        eng.scheduler.clock = clock.now
        arrivals = loadgen.poisson_arrivals(RATE, len(QUESTIONS), SEED)
        requests = []
        for i, ((cls, question, n), t) in enumerate(zip(QUESTIONS, arrivals)):
            ids = chat_prompt_ids(lab.tokenizer, [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": question}])
            sampled = i == SAMPLED
            params = SamplingParams(temperature=0.8 if sampled else 0.0, seed=1234 if sampled else None,
                                    max_tokens=n, ignore_eos=True, priority=cls)
            requests.append(eng.make_request(ids, params, arrival_time=t, request_id=f"chat{i}"))
        pending = list(reversed(requests))
        sched = eng.scheduler
        budgets: list[tuple[int, int]] = [(0, sched.max_num_batched_tokens)]
        step, last_control = 0, clock.now()
        while pending or eng.has_unfinished():
            while pending and pending[-1].arrival_time <= clock.now():
                sched.add(pending.pop())
            if not eng.has_unfinished():
                clock.wait_until(pending[-1].arrival_time)  # idle: jump to the next arrival
                continue
            if step and step % CONTROL_EVERY == 0:
                new = slo_token_budget(sched.max_num_batched_tokens, _recent_itl_p95(requests, last_control),
                                       ITL_TARGET, min_budget=MIN_BUDGET, max_budget=MAX_BUDGET)
                if new != sched.max_num_batched_tokens:
                    sched.max_num_batched_tokens = new
                    budgets.append((step, new))
                last_control = clock.now()
            before = len(eng.step_records)
            eng.step()
            for rec in eng.step_records[before:]:
                clock.advance(cost.predict(record_features(rec)))
            step += 1
        records = [{"ok": True, "ttft": r.metrics.ttft, "tpot": r.metrics.tpot} for r in requests]
        duration = max(r.metrics.finish_time for r in requests) - min(arrivals)
        good = loadgen.goodput(records, SLO_TTFT, SLO_TPOT, duration)
        schedule = [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes) for s in eng.step_records]
        tokens = [list(r.output_token_ids) for r in requests]
        hits = sum(s.prefix_hit_tokens for s in eng.step_records)
        preemptions = sum(r.metrics.num_preemptions for r in requests)
        free_after_batch = _blocks_free(eng)
        text, n_tokens = _serve_one(eng)
        free = free_after_batch and _blocks_free(eng)
    return AllRun(tokens, schedule, arrivals, budgets, good, hits, preemptions, text, n_tokens, free, calls)


def first_step_difference(sched: Sequence[tuple], ref: Sequence[tuple]) -> str:
    """What differed at the first different step: its rows (request, tokens fed) or its KV memory."""
    k = next((i for i, (a, b) in enumerate(zip(sched, ref)) if a != b), None)
    if k is None:
        return (f"the first {min(len(sched), len(ref))} steps are the same; yours ran {len(sched)} steps, "
                f"the library {len(ref)}")
    mine, lib = sched[k], ref[k]
    rows, lib_rows = list(zip(mine[0], mine[1])), list(zip(lib[0], lib[1]))
    if rows != lib_rows:
        return f"first different step: {k}: rows (request, tokens fed) yours {rows}, library {lib_rows}"
    if mine[2] == lib[2] and mine[3:] != lib[3:]:  # the host tier's part of the step (capstone._schedule)
        return (f"first different step: {k}: host tier (tokens restored, blocks copied down) yours {mine[3:]}, "
                f"library {lib[3:]} (same rows {rows})")
    return f"first different step: {k}: KV bytes held yours {mine[2]}, library {lib[2]} (same rows {rows})"


def first_token_difference(tokens: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> str:
    for i, (a, b) in enumerate(zip(tokens, ref)):
        if list(a) != list(b):
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            got = a[j] if j < len(a) else "none (ended)"
            want = b[j] if j < len(b) else "none (ended)"
            return f"request {i}, output token {j}: yours {got}, library {want}"
    return "a different number of requests finished"



def compare(yours: AllRun, library: AllRun) -> list[Check]:
    """One line per thing the two runs must share."""
    return [
        Check("arrival times (poisson_arrivals)", yours.arrivals == library.arrivals,
              "" if yours.arrivals == library.arrivals else
              f"yours {[round(t, 3) for t in yours.arrivals]}, library {[round(t, 3) for t in library.arrivals]}"),
        Check(f"tokens of {len(library.tokens)} chat requests", yours.tokens == library.tokens,
              first_token_difference(yours.tokens, library.tokens)),
        Check(f"step schedule ({len(library.schedule)} steps)", yours.schedule == library.schedule,
              "" if yours.schedule == library.schedule else first_step_difference(yours.schedule, library.schedule)),
        Check("token budgets set by the controller", yours.budgets == library.budgets,
              f"yours {yours.budgets}, library {library.budgets}"),
        Check("prefix-cache hit tokens", yours.prefix_hit_tokens == library.prefix_hit_tokens,
              f"yours {yours.prefix_hit_tokens}, library {library.prefix_hit_tokens}"),
        Check("preemptions", yours.preemptions == library.preemptions,
              f"yours {yours.preemptions}, library {library.preemptions}"),
        Check("goodput (requests/modelled s)", abs(yours.goodput - library.goodput) <= 1e-9,
              f"yours {yours.goodput:.4f}, library {library.goodput:.4f}"),
        Check("server request (chat completion)", (yours.server_text, yours.server_tokens)
              == (library.server_text, library.server_tokens),
              f"yours {yours.server_text!r} ({yours.server_tokens} tokens), "
              f"library {library.server_text!r} ({library.server_tokens} tokens)"),
        Check("KV blocks all free after the batch and the server request", yours.blocks_free,
              "yes" if yours.blocks_free else "KV blocks still held or the counts disagree (a leak or a double free)"),
    ]


def format_report(yours: AllRun, library: AllRun, checks: list[Check], missing: dict[str, list[str]]) -> str:
    opts = ", ".join(f"{k}={v}" for k, v in ENGINE.items() if k not in ("speculative", "queue_timeouts"))
    lines = [f"one engine: {opts}, n-gram speculation (k=3), queue timeouts {ENGINE['queue_timeouts']}; "
             f"time modelled by the cost model",
             f"functions plugged: {len(yours.calls)}; calls in this run: "
             + ", ".join(f"{n} {c}" for n, c in sorted(yours.calls.items(), key=lambda kv: -kv[1]))]
    width = max(len(c.what) for c in checks)
    lines.append("")
    lines += [f"{c.what.ljust(width)}  {'same' if c.same else 'DIFFERS'}"
              + ("" if c.same or not c.detail else f"  first difference: {c.detail}") for c in checks]
    lines.append(f"\nlibrary's run: {len(library.schedule)} steps, {library.prefix_hit_tokens} prefix-hit tokens, "
                 f"{library.preemptions} preemptions, budgets {library.budgets}, goodput {library.goodput:.3f}")
    if missing:
        lines.append("")
        lines += [f"still to write in exercises/{ch}.py (the library's code ran in their place): {', '.join(names)}"
                  for ch, names in missing.items()]
    lines.append("\nnot in this engine: static_schedule (ch01) and schedule_step (ch02) schedule the static and "
                 "continuous engines, greedy_generate (ch00) is a decode loop of its own, chapter 9's pieces run "
                 "a host KV tier and the SLO controller with an A/B, chapter 10's pieces split an engine over "
                 "processes and chapter 11's serve a quantized engine: python -m minillm capstone runs them")
    return "\n".join(lines)


def collect(impl: str) -> tuple[dict[str, Callable], dict[str, list[str]]]:
    """Every seam function ``impl`` has written (stubs left out), and the stubs per chapter file."""
    import importlib

    from minillm.course.grading import is_stub

    fns: dict[str, Callable] = {}
    missing: dict[str, list[str]] = {}
    for name, seam in seams.SEAMS.items():
        if name in OTHER_ENGINES:
            continue
        module = importlib.import_module(f"{impl}.{seam.chapter}")
        fn = getattr(module, name, None)
        if fn is None or is_stub(fn):
            missing.setdefault(seam.chapter, []).append(name)
        else:
            fns[name] = fn
    return fns, missing


def main_all(impl: str, lab=None, progress: bool = True) -> int:
    """``capstone --all``: the assembled engine with ``impl``'s pieces against the library's."""
    from tqdm.auto import tqdm

    from minillm.course.notebook import Lab

    fns, missing = collect(impl)
    if not fns:
        print("none of the assembled engine's functions is written yet:")
        print("\n".join(f"  exercises/{ch}.py: {', '.join(names)}" for ch, names in missing.items()))
        return 1
    lab = lab or Lab()
    runs = {}
    for side in tqdm(("library", "yours"), desc="assembled engine", disable=not progress):
        runs[side] = run_assembled(lab, None if side == "library" else fns)
    library, yours = runs["library"], runs["yours"]
    checks = compare(yours, library)
    print(format_report(yours, library, checks, missing))
    unused = sorted(n for n in fns if n not in yours.calls)
    if unused:
        print(f"\nplugged but never called in this run: {', '.join(unused)}")
    if not all(c.same for c in checks):
        print(f"\nthe assembled engine differs from the library's: {sum(not c.same for c in checks)} "
              f"of {len(checks)} checks.")
        return 1
    if missing:
        print(f"\nthe assembled engine matches the library's with {len(fns)} of your functions; "
              f"{sum(len(v) for v in missing.values())} still to write.")
        return 1
    print(f"\nall {len(fns)} of your functions serve the model in one engine exactly as the library does.")
    return 0


__all__ = ["ENGINE", "AllRun", "Check", "run_assembled", "compare", "format_report", "collect", "main_all"]
