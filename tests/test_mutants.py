"""The graders fail plausible wrong answers (tests/mutants/), each with a line that says what differed.

A grader that loses its edge (a test deleted, a case that no longer reaches a boundary)
fails here: ``tests/mutation.py`` grades every mutant in place of the reference answer,
and, for a seam, plugs it into the engine on the chapter's edge cases.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mutants

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.stem for p in (ROOT / "exercises").glob("ch*.py"))
MIN_MUTANTS = 3


def _graded(chapter: str) -> list[str]:
    module = importlib.import_module(f"exercises.{chapter}")
    return [n for n, f in inspect.getmembers(module, inspect.isfunction)
            if f.__module__ == module.__name__ and not n.startswith("_") and n != "quiz_answers"]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_graded_function_has_mutants(chapter):
    assert chapter in mutants.chapters(), f"tests/mutants/{chapter}.py is missing"
    found = mutants.of(chapter)
    fewer = getattr(importlib.import_module(f"mutants.{chapter}"), "FEWER", {})
    for name in _graded(chapter):
        n = sum(1 for m in found if m.function == name)
        need = 1 if name in fewer else MIN_MUTANTS
        assert n >= need, (f"exercises/{chapter}.py::{name} has {n} mutants in tests/mutants/{chapter}.py, needs "
                           f"{need}" + ("" if name in fewer else " (or a reason in FEWER why it has fewer ways to go wrong)"))
    unknown = {m.function for m in found} - set(_graded(chapter))
    assert not unknown, f"tests/mutants/{chapter}.py has mutants of functions the exercise does not have: {unknown}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_test_states_its_contract(chapter):
    """grade.py shows a failing test's docstring as the contract sentence the answer broke."""
    path = ROOT / "tests" / "exercises" / f"test_{chapter}.py"
    tree = ast.parse(path.read_text())
    bare = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            and not ast.get_docstring(f)]
    assert not bare, f"{path.name}: these tests need a docstring naming the contract they check: {bare}"


@pytest.mark.slow
def test_every_mutant_fails_its_grader():
    """Every chapter's mutants, in one process (a minute on 2 cores): each one caught by its
    chapter's tests with expected vs got, and a seam's rejected by the engine."""
    env = dict(os.environ, MINILLM_IMPL="solutions", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "mutation.py"), "--strict"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, f"mutants not caught:\n{done.stdout[-8000:]}\n{done.stderr[-3000:]}"
    for chapter in CHAPTERS:
        assert f"{chapter}: " in done.stdout, f"tests/mutation.py did not run {chapter}:\n{done.stdout[-3000:]}"
