"""The capstone: your engine, assembled from every piece you wrote, on the real model.

    python -m minillm capstone --impl exercises      # your code (exercises/)
    python -m minillm capstone --impl solutions      # the reference answers
    python -m minillm capstone --all                 # every piece at once, in ONE engine

Each piece is a chapter's mechanism plugged into the engine through its seam
(``minillm/seams.py``). For each piece the capstone runs a small workload of that
chapter on SmolLM2-135M twice, once with the library's code and once with yours, and
checks:

* **tokens**: every request's greedy output is token-for-token the library's (seeded
  sampling, for the rule of chapter 8's tree walk);
* **schedule**: every step fed the same requests the same number of tokens and held the
  same KV memory (for the pieces whose policy is deterministic: all of them here);
* **blocks**: after the run every KV block is free again (no leak, no double free).

It prints one row per piece (piece, chapter, status, tokens identical, schedule
identical, throughput against the library engine) and exits non-zero when anything
differs or is missing, naming the functions still to write, and for a difference the
first different step: its rows (request, tokens fed) yours and the library's. The
throughput column compares three alternated runs a side and prints a ratio only when
every run of one side beat every run of the other by more than 5%, else "within noise".

``--all`` plugs every piece into ONE engine instead (``minillm/course/one_engine.py``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from minillm import seams
from minillm.candidate_tree import MEDUSA_TREE
from minillm.course.grading import IMPLS, is_stub
from minillm.course.one_engine import first_step_difference, first_token_difference


@dataclass(frozen=True)
class Piece:
    name: str
    chapter: str  # exercises/<chapter>.py
    functions: tuple[str, ...]  # the seams (and exercise functions) this piece plugs in
    engine: dict = field(default_factory=dict)  # EngineConfig options of its run
    requests: int | None = None  # the first this many of the workload's requests (None: all)
    max_tokens: int | None = None  # at most this many output tokens a request (None: the workload's)
    interpreted: bool = False  # a Triton kernel on the CPU engine: runs only in Triton's interpreter
    temperature: float = 0.0  # 0: greedy; else sampled at this temperature, each request with its own seed


MEDUSA_TREE_SPEC = dict(method="medusa", tree=MEDUSA_TREE, disable_by_batch_size=None)  # the shipped heads

PIECES: list[Piece] = [
    Piece("decode loop", "ch00_the_model", ("greedy_generate",)),
    Piece("norm, RoPE, sampler", "ch00_the_model", ("rms_norm", "apply_rope", "sample_next_token"),
          dict(engine="paged", max_num_seqs=4, block_size=8)),
    Piece("static group policy", "ch01_static_batching", ("static_schedule",),
          dict(engine="static", max_num_seqs=3)),
    Piece("continuous scheduling step", "ch02_continuous_batching", ("schedule_step",),
          dict(engine="continuous", max_num_seqs=3)),
    Piece("blocks, slots, preemption", "ch03_paged_attention",
          ("blocks_needed", "slot_mapping", "allocate_blocks", "free_blocks", "choose_victim"),
          dict(engine="paged", max_num_seqs=4, block_size=8, num_blocks=12, max_model_len=96)),
    Piece("paged decode attention", "ch03_paged_attention", ("paged_decode_attention",),
          dict(engine="paged", max_num_seqs=4, block_size=8, attention_backend="torch")),
    Piece("K/V store kernel", "ch03_paged_attention", ("store_kv_triton",),
          dict(engine="paged", max_num_seqs=4, block_size=8, attention_backend="torch")),
    Piece("chunked-prefill budget", "ch04_chunked_prefill", ("split_budget",),
          dict(engine="paged", max_num_seqs=4, block_size=8, enable_chunked_prefill=True,
               max_num_batched_tokens=24)),
    Piece("speculative decoding", "ch05_speculative_sampling",
          ("rejection_sample_one", "ngram_propose", "rollback_blocks", "next_num_speculative_tokens"),
          dict(engine="paged", max_num_seqs=4, block_size=8,
               speculative=dict(method="ngram", num_speculative_tokens=3, adaptive=True,
                                disable_by_batch_size=None))),
    # Requests share a system prompt (prefix hits) and come in three classes; the queue
    # timeouts are out of reach, so the order does not depend on how fast this machine is
    # (the assembled engine, --all, runs them on modelled time).
    Piece("prefix cache and priority", "ch06_prefix_and_priority",
          ("longest_cached_prefix", "allocate_with_eviction", "admission_order"),
          dict(engine="paged", max_num_seqs=3, block_size=8, num_blocks=24, max_model_len=96,
               enable_prefix_caching=True, scheduling_policy="priority",
               queue_timeouts={"interactive": 1e6, "standard": 1e6, "batch": 1e6})),
    # Open-loop arrivals, goodput and the token-budget controller drive the assembled
    # engine (minillm/course/one_engine.py) on modelled time; the rest of it is the library's.
    Piece("arrivals, goodput, token budget", "ch07_serving_online",
          ("poisson_arrivals", "goodput", "next_token_budget")),
    # The shipped Medusa heads (spec_decode/medusa_smollm2.safetensors) draft a 16-node tree at
    # every step. With the rule plugged the walk asks it at every node and takes no path from
    # longest_accepted_path, so the two are rows of their own; the rule's row samples (with a
    # seed a request), where only an exact rule gives the library's tokens.
    Piece("tree mask and accepted path", "ch08_model_drafts_itself", ("tree_attention_mask", "longest_accepted_path"),
          dict(engine="paged", max_num_seqs=4, block_size=8, speculative=MEDUSA_TREE_SPEC)),
    Piece("multi-candidate rule", "ch08_model_drafts_itself", ("multi_candidate_rule",),
          dict(engine="paged", max_num_seqs=4, block_size=8, speculative=MEDUSA_TREE_SPEC), temperature=0.8),
    # The host tier copies every freed prefix block at the next step (idle_s 0: whatever the
    # clock says), so the copies of each step are part of the schedule compared.
    Piece("host KV tier", "ch09_operating_slos", ("blocks_to_offload",),
          dict(engine="paged", max_num_seqs=3, block_size=8, num_blocks=24, max_model_len=96,
               enable_prefix_caching=True, kv_offload={"host_blocks": 32, "idle_s": 0.0})),
    # The controller moves the budget on modelled time (_slo_ab_piece); then the A/B table
    # (minillm.bench.ab) compares that run with the same requests at a fixed budget.
    Piece("SLO controller and A/B", "ch09_operating_slos", ("slo_decision", "bootstrap_ci"),
          dict(engine="paged", max_num_seqs=4, block_size=8, max_model_len=256, enable_chunked_prefill=True,
               max_num_batched_tokens=128,
               slo={"ttft_p95": 0.4, "itl_p95": 0.07, "window_s": 0.6, "interval_s": 0.3, "min_budget": 8})),
    # Two ranks, each a process: the learner's shards cut the weights, the learner's MLP
    # (from the exercises module, which the workers import) runs on every rank.
    Piece("tensor parallelism", "ch10_beyond_one_device", ("shard_linear", "parallel_mlp", "allreduce_bytes_per_step"),
          dict(engine="paged", max_num_seqs=4, block_size=8, tensor_parallel_size=2, device="cpu", dtype="float32")),
    Piece("quantized weights", "ch11_quantized_weights", ("quantize_groups", "dequantize_groups"),
          dict(engine="paged", max_num_seqs=4, block_size=8, quantization="q4", device="cpu", dtype="float32")),
    # Quantized layers live on the CPU, so the kernel runs in Triton's interpreter there, 121
    # launches a step of tens of milliseconds each: one request, two steps.
    Piece("8-bit GEMV kernel", "ch11_quantized_weights", ("int8_gemv_triton",),
          dict(engine="paged", max_num_seqs=1, block_size=8, quantization="int8", device="cpu", dtype="float32"),
          requests=1, max_tokens=2, interpreted=True),
]
SHARED_PREFIX = "You are a helpful assistant. Answer briefly and stay on topic.\n\n"
CLASSES = ("interactive", "standard", "batch")

# The workload every engine piece runs: short prompts, some with repeats (prompt lookup
# finds drafts in them), outputs of different lengths (requests leave at different steps).
PROMPTS = [
    "The capital of France is",
    "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
    "Again: Monday, Tuesday,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Once upon a time",
    "Name three primary colors.",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
OUTPUT_LENS = [8, 16, 12, 4, 6, 10]


@dataclass
class PieceResult:
    piece: Piece
    status: str  # "ok" | "differs" | "missing" | "error" | "skipped"
    tokens_identical: bool | None = None
    schedule_identical: bool | None = None
    blocks_free: bool | None = None
    speed: float | None = None  # library seconds / yours, when every run of one side beat the other's
    timed: bool = False  # throughput measured (None above: within this machine's noise)
    missing: list[str] = field(default_factory=list)
    detail: str = ""


class _Missing(Exception):
    pass


def load_functions(impl: str, piece: Piece) -> tuple[dict[str, Callable], list[str]]:
    """The piece's functions from ``impl``/ (exercises or solutions), and the names still stubs."""
    if impl not in IMPLS:
        raise ValueError(f"--impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    module = importlib.import_module(f"{impl}.{piece.chapter}")  # installed with minillm (pyproject.toml)
    fns, missing = {}, []
    for name in piece.functions:
        fn = getattr(module, name, None)
        if fn is None or is_stub(fn):
            missing.append(name)
        else:
            fns[name] = _strict(name, fn)
    return fns, missing


def _strict(name: str, fn: Callable) -> Callable:
    return _Strict(name, fn)


class _Strict:
    """``fn``, with a stub's NotImplementedError turned into ``_Missing(name)``. A class, not a
    closure, so a piece run in other processes (tensor parallelism's workers) can send it."""

    def __init__(self, name: str, fn: Callable):
        self.__name__, self.fn = name, fn

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except NotImplementedError as e:
            raise _Missing(self.__name__) from e


def _schedule(engine) -> list[tuple]:
    """Per step: the rows, the KV bytes held; with a host tier, the tokens it restored and the blocks copied down."""
    host = getattr(engine.config, "kv_offload", None) is not None
    return [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes)
            + ((s.host_hit_tokens, s.kv_blocks_offloaded) if host else ()) for s in engine.step_records]


def _run_engine(lab, options: dict, prompts: list[list[int]], classes: Sequence[str] | None = None,
                max_tokens: int | None = None, temperature: float = 0.0):
    from minillm.sampling_params import SamplingParams

    eng = lab.engine(**options)
    reqs = [eng.make_request(p, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                                               seed=i if temperature > 0 else None,
                                               priority=classes[i % len(classes)] if classes else "standard"))
            for i, (p, n) in enumerate(zip(prompts, [min(n, max_tokens or n) for n in OUTPUT_LENS]))]
    t0 = time.perf_counter()
    try:
        outs = eng.run(reqs)
    finally:
        eng.close()  # a tensor-parallel engine's workers stop now, not at garbage collection
    wall = time.perf_counter() - t0
    bm = eng.scheduler.block_manager
    try:
        bm.check_invariants()
        free = bm.num_free_blocks == bm.num_blocks and not eng.has_unfinished()
    except AssertionError:  # counts that disagree with the tables: a leak or a double free
        free = False
    return [o.token_ids for o in outs], _schedule(eng), free, wall


SPEED_REPEATS = 3  # alternating runs of each side for the throughput column (1: not timed)
SPEED_MARGIN = 0.05  # a ratio within 5% of 1 is not called a difference


def speed_verdict(lib_times: Sequence[float], own_times: Sequence[float]) -> float | None:
    """Library seconds / yours (medians) when every run of one side beat every run of the
    other by more than ``SPEED_MARGIN``; else None: within this machine's noise, and no ratio
    is printed as a result. (Two alternated runs a side would separate by chance one time in
    three; three a side, one time in ten.)"""
    if len(lib_times) < 2 or len(own_times) < 2:
        return None
    ratio = sorted(lib_times)[len(lib_times) // 2] / sorted(own_times)[len(own_times) // 2]
    apart = max(own_times) < min(lib_times) or max(lib_times) < min(own_times)
    return ratio if apart and abs(ratio - 1) > SPEED_MARGIN else None


def _ch00_loop(lab, greedy_generate: Callable, prompt: list[int], n: int) -> list[int]:
    """The learner's decode loop around the real model: a forward with a one-sequence cache."""
    import torch

    from minillm.attention import AttentionMetadata
    from minillm.model_runner import allocate_kv_cache

    eng = lab.engine("continuous", max_num_seqs=1)
    model, cfg = eng.runner.model, eng.model_config
    max_len = len(prompt) + n + 1
    kv = allocate_kv_cache(cfg, num_blocks=1, block_size=max_len, device=torch.device("cpu"), dtype=torch.float32)

    @torch.inference_mode()
    def forward(token_ids: list[int], start: int) -> torch.Tensor:
        end = start + len(token_ids)
        if end > max_len:
            raise ValueError(f"forward past the cache: positions {start}..{end - 1}, cache holds {max_len}")
        i32 = dict(dtype=torch.int32)
        meta = AttentionMetadata(slot_mapping=torch.arange(start, end), block_tables=torch.zeros(1, 1, **i32),
                                 query_start_loc=torch.tensor([0, len(token_ids)], **i32),
                                 context_lens=torch.tensor([end], **i32), block_size=max_len,
                                 query_lens_list=[len(token_ids)], context_lens_list=[end])
        hidden = model(torch.tensor(token_ids), torch.arange(start, end), meta, kv)
        return model.compute_logits(hidden)

    return list(greedy_generate(forward, list(prompt), n, -1))  # no EOS: exactly n tokens, like ignore_eos


SLO_ARRIVAL_GAP = 0.1  # modelled seconds between two arrivals of the SLO piece's requests


def _modelled_run(lab, options: dict, prompts: list[list[int]], plug: dict[str, Callable]):
    """``prompts`` arriving every ``SLO_ARRIVAL_GAP`` modelled seconds; after each step the clock
    advances by the cost model's prediction (as in ``one_engine``), so the SLO controller sees
    the same latencies on every machine. (engine, requests)."""
    from minillm.bench.cost_model import CostModel, record_features
    from minillm.clock import VirtualClock
    from minillm.sampling_params import SamplingParams

    cost, clock = CostModel(), VirtualClock()
    eng = lab.engine(**options)
    eng.clock = clock
    eng.scheduler.clock = clock.now
    reqs = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=OUTPUT_LENS[i % len(OUTPUT_LENS)],
                                              ignore_eos=True), arrival_time=SLO_ARRIVAL_GAP * i)
            for i, p in enumerate(prompts)]
    with seams.plug(**plug):
        while eng.has_unfinished():
            before = len(eng.step_records)
            eng.step()
            for rec in eng.step_records[before:]:
                clock.advance(cost.predict(record_features(rec)))
    return eng, reqs


def _load_result(reqs, label: str):
    """The requests of a modelled run as a load result (``minillm.bench.ab.compare`` reads those)."""
    from minillm.bench.loadgen import LoadResult

    records = []
    for r in reqs:
        m = r.metrics
        records.append({"ok": True, "ttft": m.ttft, "tpot": m.tpot, "e2e": m.finish_time - m.arrival_time,
                        "itls": [b - a for a, b in zip(m.token_times, m.token_times[1:])],
                        "arrival": m.arrival_time, "lag": 0.0, "output_tokens": len(r.output_token_ids),
                        "status": 200})
    start = min(r.metrics.arrival_time for r in reqs)
    return LoadResult("modelled", None, records, max(r.metrics.finish_time for r in reqs) - start, label=label)


def _slo_ab_piece(lab, piece: Piece, fns: dict[str, Callable], prompts: list[list[int]]) -> PieceResult:
    """Chapter 9's controller and A/B: the engine with ``piece.engine``'s SLO targets on modelled time,
    the library's rule against yours (tokens, schedule, every budget move); then the A/B table of
    that run against the same requests at a fixed budget, the library's bootstrap against yours
    (every row's B - A; the verdict of every row whose interval is clear of 0 by a tenth of its width)."""
    from minillm.bench import ab

    work = [(lab.tokenizer(SHARED_PREFIX).input_ids + p) * 3 for p in prompts] * 2  # long enough to chunk
    _, fixed_reqs = _modelled_run(lab, {k: v for k, v in piece.engine.items() if k != "slo"}, work, {})
    lib, lib_reqs = _modelled_run(lab, piece.engine, work, {})
    own, own_reqs = _modelled_run(lab, piece.engine, work, {"slo_decision": fns["slo_decision"]})
    moves = [[(e.old_budget, e.new_budget, e.reason) for e in eng.slo_controller.events] for eng in (own, lib)]
    tokens = [[list(r.output_token_ids) for r in reqs] for reqs in (own_reqs, lib_reqs)]
    same_tokens, same_sched = tokens[0] == tokens[1], _schedule(own) == _schedule(lib)
    notes = []
    if moves[0] != moves[1]:
        k = next((i for i, (m, n) in enumerate(zip(*moves)) if m != n), min(map(len, moves)))
        mine, theirs = (m[k] if k < len(m) else "none" for m in moves)
        notes.append(f"budget move {k} (old, new, why): yours {mine}, library {theirs}")
    if not same_sched:
        notes.append(first_step_difference(_schedule(own), _schedule(lib)))
    if not same_tokens:
        notes.append(first_token_difference(*tokens))
    bm = own.scheduler.block_manager
    try:
        bm.check_invariants()
        free = bm.num_free_blocks == bm.num_blocks and not own.has_unfinished()
    except AssertionError:
        free = False
    a, b = _load_result(fixed_reqs, "fixed budget"), _load_result(lib_reqs, "SLO controller")
    want = ab.compare(a, b, n_boot=1000)
    with seams.plug(bootstrap_ci=fns["bootstrap_ci"]):
        got = ab.compare(a, b, n_boot=1000)
    for w, g in zip(want, got):
        if w.ci_low is None:
            continue
        width = w.ci_high - w.ci_low
        clear = width == 0 or min(abs(w.ci_low), abs(w.ci_high)) > 0.1 * width
        if abs(g.diff - w.diff) > 1e-9 * max(1.0, abs(w.diff)) or (clear and g.verdict != w.verdict):
            notes.append(f"A/B (SLO controller against a fixed budget), {w.metric}: B - A yours {g.diff:.6g} "
                         f"[{g.ci_low:.4g}, {g.ci_high:.4g}] {g.verdict}, library {w.diff:.6g} "
                         f"[{w.ci_low:.4g}, {w.ci_high:.4g}] {w.verdict}")
            break
    ok = not notes and free
    if not free:
        notes.append("KV blocks still held after the run (a leak)")
    same_moves = moves[0] == moves[1]
    return PieceResult(piece, "ok" if ok else "differs", same_tokens, same_sched and same_moves, free,
                       detail="; ".join(notes))


def run_piece(lab, piece: Piece, impl: str, prompts: list[list[int]],
              override: dict[str, Callable] | None = None, repeats: int = SPEED_REPEATS) -> PieceResult:
    """One row of the table. ``override`` replaces some of the piece's functions (tests
    use it to plug deliberately wrong ones)."""
    fns, missing = load_functions(impl, piece)
    for name, fn in (override or {}).items():
        fns[name] = _strict(name, fn)
        if name in missing:
            missing.remove(name)
    if missing:
        return PieceResult(piece, "missing", missing=missing)
    if piece.interpreted and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return PieceResult(piece, "skipped", detail="its Triton kernel runs on the CPU engine, in Triton's interpreter: "
                                                    "run the capstone with TRITON_INTERPRET=1")
    try:
        if piece.name == "decode loop":
            eng = lab.engine("continuous", max_num_seqs=1)
            from minillm.sampling_params import SamplingParams

            lib_t, own_t, ref, got = [], [], None, None
            for _ in range(repeats):
                t0 = time.perf_counter()
                ref = [o.token_ids for o in eng.run([eng.make_request(p, SamplingParams(
                    temperature=0.0, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts[:3], OUTPUT_LENS[:3])])]
                lib_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = [_ch00_loop(lab, fns["greedy_generate"], p, n) for p, n in zip(prompts[:3], OUTPUT_LENS[:3])]
                own_t.append(time.perf_counter() - t0)
            same = got == ref
            detail = "" if same else first_token_difference(got, ref)
            return PieceResult(piece, "ok" if same else "differs", same, None, None,
                               speed_verdict(lib_t, own_t), repeats > 1, detail=detail)
        if not piece.engine:  # chapter 7: the assembled engine's driver, the rest the library's
            from minillm.course import one_engine

            library = one_engine.run_assembled(lab, None)
            yours = one_engine.run_assembled(lab, fns)
            checks = one_engine.compare(yours, library)
            bad = [c for c in checks if not c.same]
            return PieceResult(piece, "differs" if bad else "ok", yours.tokens == library.tokens,
                               yours.schedule == library.schedule, yours.blocks_free,
                               detail="; ".join(f"{c.what}: {c.detail}" for c in bad))
        if piece.engine.get("slo"):  # chapter 9: the controller on modelled time, then an A/B
            return _slo_ab_piece(lab, piece, fns, prompts)
        classes = CLASSES if piece.engine.get("scheduling_policy") == "priority" else None
        work = [lab.tokenizer(SHARED_PREFIX).input_ids + p for p in prompts] if piece.engine.get(
            "enable_prefix_caching") else prompts
        work = work[:piece.requests]  # None: every request
        plug = {k: v for k, v in fns.items() if k in seams.SEAMS}
        lib_t, own_t = [], []
        for _ in range(repeats):
            ref_tokens, ref_sched, _, t = _run_engine(lab, piece.engine, work, classes, piece.max_tokens,
                                                      piece.temperature)
            lib_t.append(t)
            with seams.plug(**plug):
                tokens, sched, free, t = _run_engine(lab, piece.engine, work, classes, piece.max_tokens,
                                                     piece.temperature)
            own_t.append(t)
    except _Missing as e:
        return PieceResult(piece, "missing", missing=[str(e)])
    except RuntimeError as e:  # the engine stopped making progress (see LLMEngine._check_progress)
        return PieceResult(piece, "differs", blocks_free=False if "KV blocks" in str(e) else None,
                           detail=f"{e}")
    except seams.SeamContractError as e:  # a rule the engine relies on, broken: the engine stopped before acting
        return PieceResult(piece, "differs", detail=f"the engine stopped: {e}")
    except Exception as e:  # the learner's code crashed inside the engine: say where, keep going
        return PieceResult(piece, "error", detail=f"{type(e).__name__}: {e}")
    same_tokens, same_sched = tokens == ref_tokens, sched == ref_sched
    notes = []
    if not same_sched:
        notes.append(first_step_difference(sched, ref_sched))
    if not same_tokens:
        notes.append(first_token_difference(tokens, ref_tokens))
    if not free:
        notes.append("KV blocks still held after the run (a leak)")
    ok = same_tokens and same_sched and free
    return PieceResult(piece, "ok" if ok else "differs", same_tokens, same_sched, free,
                       speed_verdict(lib_t, own_t), repeats > 1, detail="; ".join(notes))


def format_table(results: Sequence[PieceResult]) -> str:
    def yn(v):
        return "-" if v is None else ("yes" if v else "NO")

    rows = [("piece", "chapter", "status", "tokens identical", "schedule identical", "blocks freed",
             "throughput vs library")]
    for r in results:
        speed = f"{r.speed:.2f}x" if r.speed is not None else ("within noise" if r.timed else "-")
        rows.append((r.piece.name, r.piece.chapter[:4], r.status, yn(r.tokens_identical), yn(r.schedule_identical),
                     yn(r.blocks_free), speed))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    notes = []
    for r in results:
        if r.missing:
            notes.append(f"{r.piece.name}: still to write in exercises/{r.piece.chapter}.py: {', '.join(r.missing)}")
        elif r.detail:
            notes.append(f"{r.piece.name}: {r.detail}")
    return "\n".join(lines + ([""] + notes if notes else []))


def run(impl: str = "exercises", pieces: Sequence[str] | None = None, progress: bool = True,
        override: dict[str, dict[str, Callable]] | None = None, repeats: int = SPEED_REPEATS) -> list[PieceResult]:
    """Run the selected pieces (names or chapter prefixes such as "ch03"); all by default.
    ``repeats``: alternated runs a side (1: tokens and schedules only, no throughput column)."""
    from tqdm.auto import tqdm

    from minillm.course.notebook import Lab

    chosen = PIECES if not pieces else [p for p in PIECES if p.name in pieces or p.chapter[:4] in pieces]
    if pieces and not chosen:
        raise ValueError(f"no piece matches {list(pieces)}; pieces: {', '.join(p.name for p in PIECES)} "
                         f"(or a chapter such as ch03)")
    for p in chosen:  # fail fast on a bad --impl, before the model loads
        load_functions(impl, p)
    lab = Lab()
    prompts = [lab.tokenizer(t).input_ids for t in PROMPTS]
    results = []
    for piece in tqdm(chosen, desc="capstone", disable=not progress):
        results.append(run_piece(lab, piece, impl, prompts, (override or {}).get(piece.name), repeats))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm capstone",
                                description="Assemble an engine from your exercise pieces and run every chapter's "
                                            "workload on the real model against the library's engine.")
    p.add_argument("--impl", choices=IMPLS, default="exercises",
                   help="whose code: exercises (yours, default) or solutions (the reference)")
    p.add_argument("--piece", action="append", default=None, metavar="NAME",
                   help="only this piece (its name, or a chapter such as ch03); repeatable")
    p.add_argument("--all", action="store_true",
                   help="plug every piece into ONE engine at once (paged, chunked prefill, prefix caching, "
                        "priority, n-gram speculation) and serve chat requests and a server request with it")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.all and args.piece:
        p.error("--all runs every piece in one engine: leave out --piece")
    import torch

    if not torch.cuda.is_available():  # chapter 3's Triton kernel runs in Triton's interpreter on a CPU;
        os.environ.setdefault("TRITON_INTERPRET", "1")  # set before your exercise files are imported
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    if args.all:
        from minillm.course.one_engine import main_all

        return main_all(args.impl, progress=not args.no_progress)
    results = run(args.impl, args.piece, progress=not args.no_progress)
    print(format_table(results))
    bad = [r for r in results if r.status not in ("ok", "skipped")]
    if bad:
        print(f"\n{len(bad)} of {len(results)} pieces not yet the library's engine.")
        return 1
    skipped = sum(r.status == "skipped" for r in results)
    print(f"\nall {len(results) - skipped} pieces" + (f" ({skipped} skipped)" if skipped else "")
          + " run the real model exactly as the library does.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
