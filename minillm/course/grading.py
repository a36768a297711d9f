"""Notebook side of the exercises: use the learner's function where it is written, grade a chapter.

``MINILLM_IMPL`` picks whose code the chapters plug in, as it does for the graders:
``exercises`` (default: the learner's files) or ``solutions`` (the reference answers;
CI runs the chapters with it). A stub that still raises ``NotImplementedError`` is
reported in one line and the reference answer runs in its place, so every chapter runs
top to bottom before a single exercise is written.

    from minillm.course.grading import mine, show_grade
    schedule_step = mine("ch02_continuous_batching", "schedule_step")
    show_grade("ch02")          # the score table of tests/grade.py for this chapter
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
from collections import deque
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]  # the repository: exercises/, solutions/, tests/
IMPLS = ("exercises", "solutions")


def impl() -> str:
    name = os.environ.get("MINILLM_IMPL", "exercises").strip() or "exercises"
    if name not in IMPLS:
        raise ValueError(f"MINILLM_IMPL must be one of {', '.join(IMPLS)}, got {name!r}")
    return name


def _module(package: str, chapter: str):
    """``exercises.chNN_...`` or ``solutions.chNN_...``: both are installed with minillm (pyproject.toml)."""
    return importlib.import_module(f"{package}.{chapter}")


def mine(chapter: str, name: str) -> Callable[..., Any]:
    """``name`` from the learner's chapter file (or ``solutions/`` under MINILLM_IMPL=solutions).

    The returned function calls the learner's; if that raises NotImplementedError, it
    says so once and calls the reference answer from ``solutions/`` from then on.
    ``.source`` tells whose code ran last ("exercises", "solutions" or "solutions (fallback)").
    """
    package = impl()
    own = getattr(_module(package, chapter), name, None)
    ref = getattr(_module("solutions", chapter), name)
    if own is None:
        print(f"{package}/{chapter}.py has no {name}(): using the reference answer")
        own = ref
    return Mine(package, chapter, name, own, ref)


class Mine:
    """What ``mine`` returns: the learner's function, the reference answer in its place once
    it raises NotImplementedError. A class, not a closure: an engine that runs the seam in
    other processes (chapter 10's tensor-parallel workers) can send it there, the two
    functions by reference to their modules."""

    def __init__(self, package: str, chapter: str, name: str, own: Callable, ref: Callable):
        self.package, self.chapter, self.name, self.own, self.ref = package, chapter, name, own, ref
        self.source = package
        functools.update_wrapper(self, ref)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.source.endswith("(fallback)"):
            return self.ref(*args, **kwargs)
        try:
            return self.own(*args, **kwargs)
        except NotImplementedError:
            print(f"{self.package}/{self.chapter}.py::{self.name} is not written yet: this run uses the reference answer")
            self.source = "solutions (fallback)"
            return self.ref(*args, **kwargs)


def is_stub(fn: Callable) -> bool:
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


def show_grade(chapter: str, impl_name: str | None = None, timeout: float = 300.0) -> str:
    """Run ``tests/grade.py`` for one chapter in a fresh interpreter (it reloads your files)
    and print its score table; returns the text."""
    cmd = [sys.executable, str(ROOT / "tests" / "grade.py"), chapter, "--impl", impl_name or impl()]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    text = (done.stdout + done.stderr).rstrip()
    print(text)
    return text


def schedule_of(steps) -> list[tuple]:
    """What "the same schedule" means: per step, who ran, how many tokens each fed, KV memory held."""
    return [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes) for s in steps]


def run_in_engine(lab, chapter: str, names: list[str], engine: str, workload, reference=None, **options):
    """The real engine on ``workload`` with the learner's functions ``names`` plugged into
    their seams (``minillm/seams.py``), next to the library's own run (``reference``, run
    here when not given). Prints whose code ran and whether the greedy tokens and the step
    schedule are identical; then runs the chapter's edge cases (``minillm/course/edges``:
    budgets that bind, prompts that end on a block edge, preemption, ...), where a plausible
    mistake shows even when this workload does not reach it. Returns (reference, yours), two
    ``RunResult``s to chart; ``yours.extra`` holds ``same_tokens``, ``same_schedule`` and
    ``same_at_the_edges``. A function that breaks a rule the engine relies on stops the run
    with a ``seams.SeamContractError`` naming the rule and the step."""
    from minillm import seams
    from minillm.course import edges

    fns = {n: mine(chapter, n) for n in names}
    if reference is None:
        reference = lab.run(engine, workload, progress=False, **options)
    with seams.plug(**fns):  # a broken rule stops here with a SeamContractError that names it
        yours = lab.run(engine, workload, progress=False, **options)
    same_tokens = yours.output_token_ids == reference.output_token_ids
    same_schedule = schedule_of(yours.steps) == schedule_of(reference.steps)
    whose = ", ".join(f"{n} ({f.source})" for n, f in fns.items())
    print(f"{engine} engine with {whose}: {len(yours.steps)} steps (library: {len(reference.steps)}); "
          f"tokens identical: {same_tokens}; schedule identical: {same_schedule}")
    problems = edges.report(chapter, fns)
    yours.extra.update(same_tokens=same_tokens, same_schedule=same_schedule, same_at_the_edges=not problems)
    return reference, yours


def replay_schedule_step(schedule_step: Callable, prompt_lens: list[int], output_lens: list[int],
                         max_num_seqs: int, max_num_batched_tokens: int) -> list[list[tuple[str, int]]]:
    """Drive a ``schedule_step(running, waiting, B, T)`` (chapter 2's exercise) over a whole
    workload with a fake forward; returns each step's rows as (request id, tokens fed),
    the same shape as the engine's step records, to compare with the real scheduler."""
    from minillm.request import Request, RequestStatus
    from minillm.sampling_params import SamplingParams

    waiting = deque(Request(str(i), [5] * p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True),
                            arrival_time=0.0)
                    for i, (p, o) in enumerate(zip(prompt_lens, output_lens)))
    running: list = []
    steps: list[list[tuple[str, int]]] = []
    while waiting or any(not r.is_finished for r in running):
        rows = list(schedule_step(running, waiting, max_num_seqs, max_num_batched_tokens))
        if not rows:
            raise RuntimeError(f"step {len(steps)}: schedule_step returned no rows while requests still wait "
                               f"or run; every step must schedule something")
        if len(steps) > 10 * (sum(output_lens) + len(output_lens)):
            raise RuntimeError("schedule_step does not finish the workload (a request never finishes?)")
        for r, n in rows:  # a fake forward: every row samples token 7
            r.num_computed_tokens += n
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                r.status = RequestStatus.FINISHED
        steps.append([(r.request_id, n) for r, n in rows])
    return steps


__all__ = ["mine", "show_grade", "impl", "replay_schedule_step", "run_in_engine", "schedule_of"]
