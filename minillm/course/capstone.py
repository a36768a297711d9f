"""The capstone: your engine, assembled from every piece you wrote, on the real model.

    python -m minillm capstone --impl exercises      # your code (exercises/)
    python -m minillm capstone --impl solutions      # the reference answers

Each piece is a chapter's mechanism plugged into the engine through its seam
(``minillm/seams.py``). For each piece the capstone runs a small workload of that
chapter on SmolLM2-135M twice, once with the library's code and once with yours, and
checks:

* **tokens**: every request's greedy output is token-for-token the library's;
* **schedule**: every step fed the same requests the same number of tokens and held the
  same KV memory (for the pieces whose policy is deterministic: all of them here);
* **blocks**: after the run every KV block is free again (no leak, no double free).

It prints one row per piece (piece, chapter, status, tokens identical, schedule
identical, throughput against the library engine) and exits non-zero when anything
differs or is missing, naming the functions still to write.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import textwrap
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from minillm import seams
from minillm.course.grading import IMPLS


@dataclass(frozen=True)
class Piece:
    name: str
    chapter: str  # exercises/<chapter>.py
    functions: tuple[str, ...]  # the seams (and exercise functions) this piece plugs in
    engine: dict = field(default_factory=dict)  # EngineConfig options of its run


PIECES: list[Piece] = [
    Piece("decode loop", "ch00_the_model", ("greedy_generate",)),
    Piece("static group policy", "ch01_static_batching", ("static_schedule",),
          dict(engine="static", max_num_seqs=3)),
    Piece("continuous scheduling step", "ch02_continuous_batching", ("schedule_step",),
          dict(engine="continuous", max_num_seqs=3)),
    Piece("blocks, slots, preemption", "ch03_paged_attention",
          ("blocks_needed", "slot_mapping", "allocate_blocks", "free_blocks", "choose_victim"),
          dict(engine="paged", max_num_seqs=4, block_size=8, num_blocks=12, max_model_len=96)),
    Piece("paged decode attention", "ch03_paged_attention", ("paged_decode_attention",),
          dict(engine="paged", max_num_seqs=4, block_size=8, attention_backend="torch")),
    Piece("chunked-prefill budget", "ch04_chunked_prefill", ("split_budget",),
          dict(engine="paged", max_num_seqs=4, block_size=8, enable_chunked_prefill=True,
               max_num_batched_tokens=24)),
    Piece("speculative decoding", "ch05_speculative_sampling",
          ("rejection_sample_one", "ngram_propose", "rollback_blocks", "next_num_speculative_tokens"),
          dict(engine="paged", max_num_seqs=4, block_size=8,
               speculative=dict(method="ngram", num_speculative_tokens=3, adaptive=True,
                                disable_by_batch_size=None))),
]

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
    status: str  # "ok" | "differs" | "missing" | "error"
    tokens_identical: bool | None = None
    schedule_identical: bool | None = None
    blocks_free: bool | None = None
    speed: float | None = None  # library seconds / your seconds
    missing: list[str] = field(default_factory=list)
    detail: str = ""


class _Missing(Exception):
    pass


def _is_stub(fn: Callable) -> bool:
    """True when the body is still only ``raise NotImplementedError`` (after the docstring)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None
            and "NotImplementedError" in ast.unparse(body[0].exc))


def load_functions(impl: str, piece: Piece) -> tuple[dict[str, Callable], list[str]]:
    """The piece's functions from ``impl``/ (exercises or solutions), and the names still stubs."""
    if impl not in IMPLS:
        raise ValueError(f"--impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    module = importlib.import_module(f"{impl}.{piece.chapter}")  # installed with minillm (pyproject.toml)
    fns, missing = {}, []
    for name in piece.functions:
        fn = getattr(module, name, None)
        if fn is None or _is_stub(fn):
            missing.append(name)
        else:
            fns[name] = _strict(name, fn)
    return fns, missing


def _strict(name: str, fn: Callable) -> Callable:
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            raise _Missing(name) from e

    call.__name__ = name
    return call


def _schedule(engine) -> list[tuple]:
    return [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes) for s in engine.step_records]


def _run_engine(lab, options: dict, prompts: list[list[int]]):
    from minillm.sampling_params import SamplingParams

    eng = lab.engine(**options)
    reqs = [eng.make_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, OUTPUT_LENS)]
    t0 = time.perf_counter()
    outs = eng.run(reqs)
    wall = time.perf_counter() - t0
    bm = eng.scheduler.block_manager
    try:
        bm.check_invariants()
        free = bm.num_free_blocks == bm.num_blocks and not eng.has_unfinished()
    except AssertionError:  # counts that disagree with the tables: a leak or a double free
        free = False
    return [o.token_ids for o in outs], _schedule(eng), free, wall


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


def run_piece(lab, piece: Piece, impl: str, prompts: list[list[int]],
              override: dict[str, Callable] | None = None) -> PieceResult:
    """One row of the table. ``override`` replaces some of the piece's functions (tests
    use it to plug deliberately wrong ones)."""
    fns, missing = load_functions(impl, piece)
    for name, fn in (override or {}).items():
        fns[name] = _strict(name, fn)
        if name in missing:
            missing.remove(name)
    if missing:
        return PieceResult(piece, "missing", missing=missing)
    try:
        if piece.chapter.startswith("ch00"):
            eng = lab.engine("continuous", max_num_seqs=1)
            from minillm.sampling_params import SamplingParams

            t0 = time.perf_counter()
            ref = [o.token_ids for o in eng.run([eng.make_request(p, SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts[:3], OUTPUT_LENS[:3])])]
            t_lib = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = [_ch00_loop(lab, fns["greedy_generate"], p, n) for p, n in zip(prompts[:3], OUTPUT_LENS[:3])]
            t_own = time.perf_counter() - t0
            same = got == ref
            return PieceResult(piece, "ok" if same else "differs", same, None, None, t_lib / t_own)
        ref_tokens, ref_sched, _, t_lib = _run_engine(lab, piece.engine, prompts)
        with seams.plug(**{k: v for k, v in fns.items() if k in seams.SEAMS}):
            tokens, sched, free, t_own = _run_engine(lab, piece.engine, prompts)
    except _Missing as e:
        return PieceResult(piece, "missing", missing=[str(e)])
    except RuntimeError as e:  # the engine stopped making progress (see LLMEngine._check_progress)
        return PieceResult(piece, "differs", blocks_free=False if "KV blocks" in str(e) else None,
                           detail=f"{e}")
    except Exception as e:  # the learner's code crashed inside the engine: say where, keep going
        return PieceResult(piece, "error", detail=f"{type(e).__name__}: {e}")
    same_tokens, same_sched = tokens == ref_tokens, sched == ref_sched
    detail = ""
    if not same_sched:
        k = next((i for i, (a, b) in enumerate(zip(sched, ref_sched)) if a != b), min(len(sched), len(ref_sched)))
        detail = f"first different step: {k} ({len(sched)} steps, library {len(ref_sched)})"
    if not free:
        detail = (detail + "; " if detail else "") + "KV blocks still held after the run (a leak)"
    ok = same_tokens and same_sched and free
    return PieceResult(piece, "ok" if ok else "differs", same_tokens, same_sched, free, t_lib / t_own, detail=detail)


def format_table(results: Sequence[PieceResult]) -> str:
    def yn(v):
        return "-" if v is None else ("yes" if v else "NO")

    rows = [("piece", "chapter", "status", "tokens identical", "schedule identical", "blocks freed",
             "throughput vs library")]
    for r in results:
        speed = "-" if r.speed is None else f"{r.speed:.2f}x"
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
        override: dict[str, dict[str, Callable]] | None = None) -> list[PieceResult]:
    """Run the selected pieces (names or chapter prefixes such as "ch03"); all by default."""
    from tqdm.auto import tqdm

    from minillm.course.notebook import Lab

    chosen = PIECES if not pieces else [p for p in PIECES if p.name in pieces or p.chapter[:4] in pieces]
    if pieces and not chosen:
        raise ValueError(f"no piece matches {list(pieces)}; pieces: {', '.join(p.name for p in PIECES)} "
                         f"(or a chapter: ch00 .. ch05)")
    for p in chosen:  # fail fast on a bad --impl, before the model loads
        load_functions(impl, p)
    lab = Lab()
    prompts = [lab.tokenizer(t).input_ids for t in PROMPTS]
    results = []
    for piece in tqdm(chosen, desc="capstone", disable=not progress):
        results.append(run_piece(lab, piece, impl, prompts, (override or {}).get(piece.name)))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm capstone",
                                description="Assemble an engine from your exercise pieces and run every chapter's "
                                            "workload on the real model against the library's engine.")
    p.add_argument("--impl", choices=IMPLS, default="exercises",
                   help="whose code: exercises (yours, default) or solutions (the reference)")
    p.add_argument("--piece", action="append", default=None, metavar="NAME",
                   help="only this piece (its name, or a chapter such as ch03); repeatable")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    results = run(args.impl, args.piece, progress=not args.no_progress)
    print(format_table(results))
    bad = [r for r in results if r.status != "ok"]
    if bad:
        print(f"\n{len(bad)} of {len(results)} pieces not yet the library's engine.")
        return 1
    print(f"\nall {len(results)} pieces run the real model exactly as the library does.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
